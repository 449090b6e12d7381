"""The export's own greedy reply, computed by the runtime's engine within a memory budget: as
many of the export's layers loaded at once as fit, the rest a group at a time."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from edgelite.config import KVStoreConfig, RuntimeConfig
from edgelite.engine.layers import LayerRange, ModelFiles, export_files
from edgelite.engine.runtime import Embedding, Head, chunks_of
from edgelite.manifest import Manifest
from edgelite_export import memory

log = logging.getLogger(__name__)
GROUP_SAFETY = 1.25  # a layer of the greedy check counted this much over its measured cost


def runtime_config() -> RuntimeConfig:
    return RuntimeConfig(threads=2, verify_hashes=False, kv_store=KVStoreConfig(budget_bytes=0))


def run_range(layers: LayerRange, slot: Any, hidden: np.ndarray) -> np.ndarray:
    """hidden (1, n, hidden) through the range for a session, in the runtime's chunks."""
    out = [layers.run(slot, hidden[:, a:b])
           for a, b in chunks_of(hidden.shape[1], layers.chunks, layers.cfg.chunk_overhead_tokens)]
    return np.concatenate(out, axis=1)


def greedy(manifest: Manifest, prompt: list[int], steps: int, budget: int) -> list[int]:
    """The export's own greedy reply to the prompt, within `budget` bytes of this process's
    memory: as many layers loaded at once as fit (measured on the first layer). All of them:
    one range for the whole reply; fewer: each step runs the layers group by group, each
    group's KV kept between steps."""
    cfg = runtime_config()
    files = export_files(manifest, verify=False)
    embed, head = Embedding(manifest, cfg, files), Head(manifest, cfg, files)
    n = manifest.num_layers
    before = memory.rss_bytes()
    first = LayerRange(manifest, 0, 0, cfg, files)
    run_range(first, first.pool.acquire(), embed.run(np.array([prompt], np.int64)))
    per_layer = max(memory.rss_bytes() - before, 1)
    first.close()
    del first
    room = budget - memory.rss_bytes() - memory.ACTIVATION_MARGIN
    group = max(1, min(n, int(room / (per_layer * GROUP_SAFETY))))
    log.info("greedy check: %d of %d layers at once (%.0f MiB a layer)", group, n, per_layer / 2**20)
    groups = [_Group(manifest, a, min(a + group, n) - 1, cfg, files, keep=group == n)
              for a in range(0, n, group)]
    out: list[int] = []
    ids = prompt
    for _ in range(steps):
        h = embed.run(np.array([ids], np.int64))
        for g in groups:
            h = g.run(h)
        out.append(int(head.run(h[:, -1:])[0, 0].argmax()))
        ids = [out[-1]]
    for g in groups:
        g.close()
    return out


class _Group:
    """Layers a..b of the greedy check: loaded for the whole reply (`keep`), or for each
    step, with the session's KV kept between steps."""

    def __init__(self, manifest: Manifest, a: int, b: int, cfg: RuntimeConfig, files: ModelFiles,
                 keep: bool) -> None:
        self.args = (manifest, a, b, cfg, files)
        self.layers = LayerRange(*self.args) if keep else None
        self.slot = self.layers.pool.acquire() if self.layers else None
        self.kv: np.ndarray | None = None  # (layers, 2, kv_heads, n, head_dim) between steps

    def run(self, h: np.ndarray) -> np.ndarray:
        if self.layers is not None and self.slot is not None:
            return run_range(self.layers, self.slot, h)
        layers = LayerRange(*self.args)
        slot = layers.pool.acquire()
        if self.kv is not None:
            layers.pool.view(slot)[:, :, :, :self.kv.shape[3]] = self.kv
            slot.length = self.kv.shape[3]
        out = run_range(layers, slot, h)
        self.kv = layers.pool.read(slot, slot.length)
        layers.close()
        return out

    def close(self) -> None:
        if self.layers is not None:
            self.layers.close()
