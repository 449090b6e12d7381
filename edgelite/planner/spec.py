"""Build a planner Problem from a manifest and a cluster description (pure: dicts in, data out).

cluster.json: {"devices": [{"name", "flops", "memory_bytes", "beta"?, "addr"?, "narrow"?}],
               "links": [{"src", "dst", "latency_ms", "bandwidth_mbps", "jitter_ms", "loss"}],
               "client": name}. A missing link means unreachable.
"""

from __future__ import annotations

from typing import Any

from edgelite.errors import EdgeliteError
from edgelite.ids import NodeAddr
from edgelite.manifest import KV_AUTO, SCRATCH_CHUNK, Manifest
from edgelite.planner.model import Device, Layer, Link, Problem, Weights

KV_TOKENS = 2048  # context each layer reserves KV memory for


def layers_of(m: Manifest, kv_tokens: int = KV_TOKENS) -> tuple[Layer, ...]:
    """Each layer's cost: what it holds once loaded (FileEntry.resident: as the exporter
    measured it) and its KV, of the dtype nodes hold by default (`--kv-dtype auto`); a
    windowed layer (Gemma 3's local ones) reserves KV for its window."""
    dtype = m.kv_dtype(KV_AUTO, invariant=True)
    return tuple(Layer(flops=float(e.flops_per_token), out_bytes=e.activation_bytes_per_token,
                       mem_bytes=e.resident + m.kv_bytes(j, j, kv_tokens, dtype),
                       narrow_mem_bytes=(e.narrow_resident_bytes + m.kv_bytes(j, j, kv_tokens, dtype)
                                         if e.narrow_resident_bytes else 0))
                 for j, e in enumerate(m.layers))


def _addr(device: dict[str, Any]) -> NodeAddr | None:
    addr = device.get("addr")
    return None if addr is None else NodeAddr.parse(str(addr))


def problem_from(m: Manifest, spec: dict[str, Any], objective: str = "latency",
                 weights: Weights | None = None, client_first: bool = True,
                 kv_tokens: int = KV_TOKENS, chunk: int = SCRATCH_CHUNK) -> Problem:
    """The planner's problem; `chunk`: the largest prompt chunk a step may carry (what it
    takes beyond the layers is counted on every device)."""
    try:
        devs = spec["devices"]
        names = [d["name"] for d in devs]
        client = spec.get("client", names[0])
        if client not in names:
            raise EdgeliteError(f"cluster: client {client!r} is not among the devices {names}")
        order = [client, *[n for n in names if n != client]]
        by_name = {d["name"]: d for d in devs}
        devices = tuple(Device(n, float(by_name[n]["flops"]), int(by_name[n]["memory_bytes"]),
                               float(by_name[n].get("beta", 0.8)),
                               None if n == client else _addr(by_name[n]),
                               bool(by_name[n].get("narrow", False)))
                        for n in order)
        index = {n: i for i, n in enumerate(order)}
        links = {}
        for link in spec.get("links", []):
            if link["src"] not in index or link["dst"] not in index:
                raise EdgeliteError(f"cluster: link {link['src']}->{link['dst']} names an "
                                    f"unknown device")
            links[index[link["src"]], index[link["dst"]]] = Link(
                float(link["latency_ms"]), float(link["bandwidth_mbps"]),
                float(link.get("jitter_ms", 0.0)), float(link.get("loss", 0.0)))
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise EdgeliteError(f"cluster description is malformed: {exc!r}") from exc
    reserved = m.client_bytes_on(devices[0].narrow)
    return Problem(layers_of(m, kv_tokens), devices, links, weights or Weights(),
                   client_first=client_first, client_reserved_bytes=reserved, objective=objective,
                   client_fixed_flops=float(m.embed.flops_per_token + m.head.flops_per_token),
                   scratch_bytes=m.scratch_for(chunk), range_bytes=m.range_bytes,
                   narrow_range_bytes=m.narrow_range_bytes)


def footprint(m: Manifest, kv_tokens: int = KV_TOKENS, chunk: int = SCRATCH_CHUNK) -> dict[str, Any]:
    """What the planner counts for the model's pieces, in bytes: each layer once loaded (on a
    device running edgelite's product operators, where the exporter measured that) and its KV
    for `kv_tokens` positions, what a device's range holds once, the client's embedding and
    head, a `chunk`-token prompt chunk's scratch on each device. A device's own process (its
    Python, onnxruntime: 60-90 MiB for a node) comes on top: a node reports its budget less
    what it holds already."""
    dtype = m.kv_dtype(KV_AUTO, invariant=True)
    layers = [L.narrow_mem_bytes or L.mem_bytes for L in layers_of(m, kv_tokens)]  # (Layer.mem_on, narrow)
    kv = m.kv_bytes(0, m.num_layers - 1, kv_tokens, dtype)
    weights = sum(e.param_bytes for e in m.layers)
    return {"kv_dtype": dtype, "kv_tokens": kv_tokens, "chunk": chunk,
            "layer_weights_bytes": weights, "layers_resident_bytes": sum(layers) - kv,
            "layers_kv_bytes": kv, "layer_bytes": layers, "range_bytes": m.range_on(True),
            "client_bytes": m.client_bytes_on(True), "scratch_bytes": m.scratch_for(chunk),
            "resident_over_weights": round((sum(layers) - kv) / weights, 2) if weights else None}
