"""What a node answers when the client profiles it: this device's FLOP/s on the model's own
layer shapes (engine/profile.py does the timing) and its memory."""

from __future__ import annotations

from typing import Any

from edgelite.config import RuntimeConfig
from edgelite.engine.profile import gemv_flops, gemv_seconds, layer_decode_seconds
from edgelite.engine.runtime import open_session
from edgelite.net.messages import LayerDesc
from edgelite.node.blobs import check_sha
from edgelite.node.stages import StageStore

MAX_PROFILE_HIDDEN = 16384  # the largest hidden size a profile GEMV may use
MAX_PROFILE_BYTES = 256 * 2**20  # the most weight bytes a profile GEMV may allocate


def measure_flops(store: StageStore, hidden_size: int, layer: LayerDesc | None,
                  repeats: int = 20) -> dict[str, Any]:
    """Effective FLOP/s on decode shapes (blocking: run off the event loop), timed on the first
    that applies: a loaded stage's layer; the client's named layer file when it is in the blob
    store; a numpy GEMV over as many weight bytes as that layer (cold cache); a GEMV of the
    hidden size."""
    stage = next(iter(store.stages.values()), None)
    if stage is not None:
        m, j = stage.manifest, stage.first
        secs = layer_decode_seconds(stage.layers.sessions[0], m.hidden_size, m.num_kv_heads,
                                    m.head_dim, repeats=repeats)
        return {"flops": m.layers[j].flops_per_token / secs, "flops_source": f"layer {j}",
                "layer_ms": secs * 1e3}
    if layer is not None:
        sha = check_sha(layer.sha256)
        shape = (layer.hidden_size, layer.num_kv_heads, layer.head_dim)
        if store.blobs.has(sha):
            sess = open_session(store.blobs.path(sha), RuntimeConfig(store.runtime.threads))
            secs = layer_decode_seconds(sess, *shape, repeats=repeats)
            source = f"layer file {sha[:12]}"
        else:
            weight_bytes = min(layer.param_bytes, MAX_PROFILE_BYTES)
            secs = gemv_seconds(min(shape[0], MAX_PROFILE_HIDDEN), weight_bytes, repeats)
            source = f"numpy gemv over {weight_bytes / 2**20:.1f} MiB (cold cache)"
        return {"flops": layer.flops_per_token / secs, "flops_source": source, "layer_ms": secs * 1e3}
    h = min(hidden_size or 2048, MAX_PROFILE_HIDDEN)
    return {"flops": gemv_flops(h, repeats), "flops_source": f"numpy gemv {h}"}
