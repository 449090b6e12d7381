"""A node's loaded stages and per-session KV caches (no networking here).

A stage is one plan's contiguous layer range on this node. Sessions hold their KV cache for
those layers within the node's memory budget.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgelite import manifest as mf
from edgelite.config import RuntimeConfig
from edgelite.engine.batch import run_batch
from edgelite.engine.runtime import KVCache, LayerRange, positions_for
from edgelite.errors import EdgeliteError, KVBudgetExceeded, ModelFileError, ProtocolError
from edgelite.ids import NodeAddr
from edgelite.node.blobs import BlobStore


@dataclass
class Stage:
    plan_id: str
    manifest: mf.Manifest
    first: int
    last: int
    layers: LayerRange
    next_addr: NodeAddr | None

    @functools.cached_property
    def kv_bytes_per_token(self) -> int:
        return sum(e.kv_bytes_per_token for e in self.manifest.layers[self.first:self.last + 1])


@dataclass
class Session:
    kv: KVCache
    last_used: float


@dataclass
class StageStore:
    blobs: BlobStore
    kv_budget_bytes: int
    runtime: RuntimeConfig
    stages: dict[str, Stage] = field(default_factory=dict)
    sessions: dict[tuple[str, str], Session] = field(default_factory=dict)
    runs: int = 0
    run_ms_total: float = 0.0
    _ranges: dict[tuple[str, int, int], LayerRange] = field(default_factory=dict)
    # the data plane thread steps sessions while the event loop ends, expires and reports them
    lock: threading.Lock = field(default_factory=threading.Lock)
    _kv_total: int = 0

    def build(self, plan_id: str, manifest_json: dict[str, Any], first: int, last: int,
              next_addr: NodeAddr | None) -> Stage:
        """Open a stage from deployed blobs (blocking: call in a thread)."""
        raw = dict(manifest_json)
        for key in ("embed", "head"):  # the node never needs these; point them at a blob name
            raw[key] = {**raw[key], "file": raw[key]["sha256"]}
        raw["layers"] = [{**e, "file": e["sha256"]} for e in raw["layers"]]
        m = mf.parse(raw, self.blobs.dir)
        if not 0 <= first <= last < m.num_layers:
            raise EdgeliteError(f"layers {first}-{last} outside 0-{m.num_layers - 1}")
        for e in m.layers[first:last + 1]:
            if not self.blobs.has(e.sha256):
                raise ModelFileError(f"layer file {e.sha256[:12]} not deployed to this node")
        key = (m.fingerprint, first, last)
        if key not in self._ranges:
            cfg = RuntimeConfig(self.runtime.threads, self.runtime.allow_spinning, verify_hashes=False)
            self._ranges[key] = LayerRange(m, first, last, cfg)
        return Stage(plan_id, m, first, last, self._ranges[key], next_addr)

    def stage_for(self, plan_id: object, fingerprint: str | None) -> Stage:
        """The loaded stage of a plan, refused when missing or when the connection asking was
        opened for another model."""
        stage = self.stages.get(plan_id)  # type: ignore[arg-type]
        if stage is None:
            raise ProtocolError(f"plan_id {plan_id!r} is not loaded on this node")
        if fingerprint is not None and stage.manifest.fingerprint != fingerprint:
            raise ProtocolError(f"plan {stage.plan_id} serves model {stage.manifest.fingerprint}, "
                                f"this connection was opened for {fingerprint}")
        return stage

    @property
    def kv_bytes(self) -> int:
        """KV held by all sessions (kept as a running total: read on every step)."""
        return self._kv_total

    def prepare(self, stage: Stage, session: str, start: int, hidden: np.ndarray) -> KVCache:
        """Check a step against the session's KV and the budget (on the event loop)."""
        with self.lock:
            sess = self.sessions.get((stage.plan_id, session))
            used = self.kv_bytes
        have = sess.kv.length if sess else 0
        if start != have:
            raise EdgeliteError(f"session {session[:12]}: this node holds KV for {have} tokens but "
                                f"the step starts at {start} (node restarted or session expired?)")
        need = stage.kv_bytes_per_token * hidden.shape[1] * hidden.shape[0]
        if used + need > self.kv_budget_bytes:
            raise KVBudgetExceeded(f"session {session[:12]}: KV needs {need} more bytes, "
                                   f"{self.kv_budget_bytes - used} of the node's "
                                   f"{self.kv_budget_bytes} left")
        return sess.kv if sess else stage.layers.new_cache(hidden.shape[0])

    def compute(self, stage: Stage, kv: KVCache, start: int,
                hidden: np.ndarray) -> tuple[np.ndarray, KVCache, float]:
        """Run the stage's layers (blocking: call in a worker thread). Touches no shared state."""
        pos, mask = positions_for(start, hidden.shape[1], hidden.shape[0])
        t0 = time.perf_counter()
        out, kv = stage.layers.run(hidden, kv, pos, mask)
        return out, kv, (time.perf_counter() - t0) * 1e3

    def compute_batch(self, stage: Stage, kvs: list[KVCache], starts: list[int],
                      hiddens: list[np.ndarray]) -> tuple[list[np.ndarray], list[KVCache], float]:
        """Decode steps of several sessions as one run (batch.py); like compute, per session."""
        t0 = time.perf_counter()
        outs, kvs = run_batch(stage.layers, hiddens, kvs, starts)
        return outs, kvs, (time.perf_counter() - t0) * 1e3

    def commit(self, stage: Stage, session: str, kv: KVCache, ms: float) -> None:
        with self.lock:
            self.run_ms_total += ms
            self.runs += 1
            old = self.sessions.get((stage.plan_id, session))
            self._kv_total += kv.nbytes - (old.kv.nbytes if old else 0)
            self.sessions[(stage.plan_id, session)] = Session(kv, time.monotonic())

    def end(self, session: str) -> int:
        """Free a session's KV in every plan; returns bytes freed."""
        with self.lock:
            keys = [k for k in self.sessions if k[1] == session]
            freed = sum(self.sessions.pop(k).kv.nbytes for k in keys)
            self._kv_total -= freed
            return freed

    def expire(self, ttl_s: float) -> int:
        now = time.monotonic()
        with self.lock:
            old = [k for k, s in self.sessions.items() if now - s.last_used > ttl_s]
            for k in old:
                self._kv_total -= self.sessions.pop(k).kv.nbytes
        return len(old)

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return self._stats()

    def _stats(self) -> dict[str, Any]:
        return {"sessions": len(self.sessions), "kv_bytes": self.kv_bytes,
                "kv_budget_bytes": self.kv_budget_bytes, "runs": self.runs,
                "ms_per_run": self.run_ms_total / self.runs if self.runs else 0.0,
                "stages": [{"plan_id": s.plan_id, "layers": [s.first, s.last]}
                           for s in self.stages.values()]}
