"""ONNX execution: embedding, a contiguous layer range with its KV cache, and the head.

Tensor names are the exporter's contract:
  embed.onnx   input_ids (batch, seq) int64                      -> hidden (batch, seq, hidden)
  layer_J.onnx hidden, past_key, past_value, position_ids, attention_mask
               -> hidden_out, present_key, present_value
  head.onnx    hidden (batch, seq, hidden)                       -> logits (batch, seq, vocab)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgelite.config import RuntimeConfig
from edgelite.errors import EdgeliteError, ModelFileError
from edgelite.manifest import FileEntry, Manifest, check_file

log = logging.getLogger(__name__)


def session_options(cfg: RuntimeConfig) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = cfg.threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if cfg.allow_spinning else "0")
    opts.log_severity_level = 3
    return opts


def open_session(path: Path, cfg: RuntimeConfig) -> ort.InferenceSession:
    try:
        return ort.InferenceSession(str(path), session_options(cfg), providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise ModelFileError(f"{path}: onnxruntime cannot load it: {str(exc).splitlines()[0]}") from exc


def _load(manifest: Manifest, entry: FileEntry, cfg: RuntimeConfig) -> ort.InferenceSession:
    return open_session(check_file(manifest, entry, cfg.verify_hashes), cfg)


@dataclass
class KVCache:
    """Keys and values of one session for a contiguous range of layers."""

    keys: list[np.ndarray] = field(default_factory=list)  # each (batch, kv_heads, past, head_dim)
    values: list[np.ndarray] = field(default_factory=list)

    @classmethod
    def empty(cls, n_layers: int, kv_heads: int, head_dim: int, batch: int = 1) -> KVCache:
        z = np.zeros((batch, kv_heads, 0, head_dim), np.float32)
        return cls([z] * n_layers, [z] * n_layers)

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2]) if self.keys else 0

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values, strict=True))


def positions_for(past: int, seq: int, batch: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Position ids (batch, seq) and an all-ones attention mask (batch, past + seq). Runs per
    step on every stage with cold caches: C-level numpy calls only."""
    pos = np.arange(past, past + seq, dtype=np.int64).reshape(1, seq)
    if batch > 1:
        pos = pos.repeat(batch, axis=0)
    return pos, np.ones((batch, past + seq), np.int64)


class Embedding:
    def __init__(self, manifest: Manifest, cfg: RuntimeConfig) -> None:
        self.session = _load(manifest, manifest.embed, cfg)

    def run(self, ids: np.ndarray) -> np.ndarray:
        return self.session.run(["hidden"], {"input_ids": ids.astype(np.int64, copy=False)})[0]


class Head:
    def __init__(self, manifest: Manifest, cfg: RuntimeConfig) -> None:
        self.session = _load(manifest, manifest.head, cfg)

    def run(self, hidden: np.ndarray) -> np.ndarray:
        return self.session.run(["logits"], {"hidden": hidden})[0]


class LayerRange:
    """Decoder layers first..last (inclusive) of one manifest."""

    def __init__(self, manifest: Manifest, first: int, last: int, cfg: RuntimeConfig) -> None:
        if not 0 <= first <= last < manifest.num_layers:
            raise EdgeliteError(f"layer range {first}-{last} is outside 0-{manifest.num_layers - 1}")
        self.manifest, self.first, self.last = manifest, first, last
        self.sessions = [_load(manifest, manifest.layers[j], cfg) for j in range(first, last + 1)]

    def new_cache(self, batch: int = 1) -> KVCache:
        m = self.manifest
        return KVCache.empty(len(self.sessions), m.num_kv_heads, m.head_dim, batch)

    def run(self, hidden: np.ndarray, kv: KVCache, positions: np.ndarray,
            mask: np.ndarray) -> tuple[np.ndarray, KVCache]:
        """hidden (batch, seq, hidden) -> the same after these layers, and the grown KV cache."""
        keys, values = [], []
        for sess, k, v in zip(self.sessions, kv.keys, kv.values, strict=True):
            hidden, k, v = sess.run(None, {"hidden": hidden, "past_key": k, "past_value": v,
                                           "position_ids": positions, "attention_mask": mask})
            keys.append(k)  # (batch, kv_heads, past + seq, head_dim)
            values.append(v)
        return hidden, KVCache(keys, values)


class LocalChain:
    """The whole model in one process: the reference engine."""

    def __init__(self, manifest: Manifest, cfg: RuntimeConfig | None = None) -> None:
        cfg = cfg or RuntimeConfig()
        self.manifest = manifest
        self.embed = Embedding(manifest, cfg)
        self.layers = LayerRange(manifest, 0, manifest.num_layers - 1, cfg)
        self.head = Head(manifest, cfg)

    def forward(self, ids: np.ndarray, kv: KVCache) -> tuple[np.ndarray, KVCache]:
        """ids (batch, seq) -> logits of the last position (batch, vocab), grown cache."""
        pos, mask = positions_for(kv.length, ids.shape[1], ids.shape[0])
        hidden, kv = self.layers.run(self.embed.run(ids), kv, pos, mask)
        return self.head.run(hidden[:, -1:, :])[:, 0, :], kv


class ClientPart:
    """What the client runs of a plan: the embedding, its own prefix of the layers (if any)
    and the head. Per-session KV of the prefix layers lives here; one thread uses it."""

    def __init__(self, manifest: Manifest, cfg: RuntimeConfig,
                 layers: tuple[int, int] | None = None) -> None:
        self.manifest = manifest
        self.embed, self.head_ = Embedding(manifest, cfg), Head(manifest, cfg)
        self.prefix = LayerRange(manifest, *layers, cfg) if layers else None
        self.caches: dict[str, KVCache] = {}

    def front(self, session: str, start: int, ids: np.ndarray) -> np.ndarray:
        """ids (1, seq) at position `start` -> the hidden state the first node stage takes."""
        hidden = self.embed.run(ids)
        if self.prefix is None:
            return hidden
        pos, mask = positions_for(start, ids.shape[1], ids.shape[0])
        kv = self.caches.get(session) or self.prefix.new_cache(ids.shape[0])
        hidden, self.caches[session] = self.prefix.run(hidden, kv, pos, mask)
        return hidden

    def head(self, hidden: np.ndarray) -> np.ndarray:
        """The last stage's output (1, seq, hidden) -> logits (vocab,) of the last position."""
        return self.head_.run(np.ascontiguousarray(hidden[:, -1:, :]))[0, 0]

    def end(self, session: str) -> None:
        self.caches.pop(session, None)
