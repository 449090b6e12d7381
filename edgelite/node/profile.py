"""What a node answers when the client profiles it: this device's FLOP/s on the model's own
layer shapes (engine/profile.py does the timing) and its memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgelite import manifest as mf
from edgelite.config import RuntimeConfig
from edgelite.engine.layers import LayerRange
from edgelite.engine.profile import gemv_flops, gemv_seconds, range_decode_seconds
from edgelite.errors import ModelFileError
from edgelite.node.stages import StageStore


def loaded_flops(store: StageStore, repeats: int = 20) -> dict[str, Any] | None:
    """Effective FLOP/s of a loaded stage's layers on decode shapes (None: nothing loaded). On
    the data plane's thread, which owns the stages' KV."""
    stage = next(iter(store.stages.values()), None)
    if stage is None:
        return None
    m, first, last = stage.manifest, stage.first, stage.last
    secs = range_decode_seconds(stage.layers, repeats=repeats)
    flops = sum(e.flops_per_token for e in m.layers[first:last + 1])
    return {"flops": flops / secs, "flops_source": f"layers {first}-{last}",
            "layer_ms": secs * 1e3 / (last - first + 1)}


def measure_flops(store: StageStore, hidden_size: int, manifest: dict[str, Any] | None,
                  max_hidden: int, max_bytes: int, repeats: int = 20,
                  runtime: RuntimeConfig | None = None) -> dict[str, Any]:
    """Effective FLOP/s on decode shapes when no stage is loaded (blocking: run off the event
    loop), timed on the first that applies: the model's layer 0 when its files are in the blob
    store; a numpy GEMV over as many weight bytes as that layer (cold cache, at most
    `max_bytes`); a GEMV of the hidden size (at most `max_hidden`). `runtime`: the layer's
    settings, if not the node's."""
    if manifest is not None:
        m = mf.parse(manifest, Path(store.blobs.dir))
        e = m.layers[0]
        try:
            layer = LayerRange(m, 0, 0, runtime or store.runtime, store.files(m))
        except ModelFileError:
            weight_bytes = min(e.param_bytes, max_bytes)
            secs = gemv_seconds(min(m.hidden_size, max_hidden), weight_bytes, repeats)
            source = f"numpy gemv over {weight_bytes / 2**20:.1f} MiB (cold cache)"
        else:
            try:
                secs = range_decode_seconds(layer, repeats=repeats)
            finally:
                layer.close()
            source = "layer 0"
        return {"flops": e.flops_per_token / secs, "flops_source": source, "layer_ms": secs * 1e3}
    h = min(hidden_size or 2048, max_hidden, int((max_bytes / 16) ** 0.5))  # (h, 4h) float32
    return {"flops": gemv_flops(h, repeats), "flops_source": f"numpy gemv {h}"}
