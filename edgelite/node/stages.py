"""A node's loaded stages and its sessions' KV (no networking here).

A stage is one plan's contiguous layer range on this node; plans with the same model and range
share one LayerRange (one onnxruntime session, one KV pool). A session of a plan holds a slot of
that pool. Sessions are accounted by KV capacity bucket within the node's budget.

Threads: the event loop builds stages (in a worker thread) and reads stats; everything that
touches sessions (steps, ending, expiry) runs on the data plane's thread.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from edgelite import manifest as mf
from edgelite.config import MAX_ROLLBACK, RuntimeConfig
from edgelite.engine.kv import Slot
from edgelite.engine.kvfile import Layout
from edgelite.engine.layers import LayerRange, ModelFiles
from edgelite.engine.passes.linear import narrow  # (edgelite's product operators: what layers hold)
from edgelite.engine.profile import resident_bytes
from edgelite.errors import EdgeliteError, ModelFileError, ProtocolError
from edgelite.ids import NodeAddr
from edgelite.node.blobs import BlobStore
from edgelite.node.memory import Limits


@dataclass
class Stage:
    plan_id: str
    manifest: mf.Manifest
    first: int
    last: int
    layers: LayerRange
    next_addr: NodeAddr | None
    owner: str = ""  # the client (control connection) that loaded it
    capability: str = ""  # what opens a data connection of this plan
    next_capability: str | None = None  # what opens the next stage's
    range_key: tuple[str, int, int] = ("", 0, 0)  # its LayerRange in StageStore.ranges
    kv_domain: str = ""  # whose KV its sessions store and restore (kv_domain())
    address: str = ""  # where its client connected from (its share of the KV budget)
    chunk_limit: int = 0  # the most tokens its plan's steps carry (Load.max_chunk; 0: none)

    @property
    def max_chunk(self) -> int:
        """The most tokens one of its steps may carry."""
        return min(self.layers.max_chunk, self.chunk_limit or self.layers.max_chunk)

    @property
    def kv_layout(self) -> Layout:
        """The layout of its KV store entries: its range's, within its client's domain."""
        return replace(self.layers.layout, domain=self.kv_domain)


def files_in_use(stages: dict[str, Stage]) -> set[str]:
    """The sha256 of every file the stages use (their blobs are never deleted)."""
    return {d.sha256 for s in list(stages.values())
            for e in s.manifest.layers[s.first:s.last + 1] for d in (e, *e.data)}


def kv_domain(key: str) -> str:
    """The KV domain of a client's key (Auth.kv, else Auth.client, else one connection's): a
    one-way name, so that the nodes that pass a client's KV between them learn no key."""
    return hashlib.sha256(b"edgelite kv domain\0" + key.encode()).hexdigest()[:32]


@dataclass
class Session:
    stage: Stage
    slot: Slot
    last_used: float


@dataclass
class Restoring:
    """A slot being filled from the KV store: not a session's yet, but counted in the budget."""

    stage: Stage
    slot: Slot
    nbytes: int


@dataclass
class StageStore:
    blobs: BlobStore
    limits: Limits  # memory.py: the memory and KV budgets
    runtime: RuntimeConfig
    scratch_bytes: int = 0  # the headroom a prompt chunk needs (the loaded models' largest)
    stages: dict[str, Stage] = field(default_factory=dict)
    sessions: dict[tuple[str, str], Session] = field(default_factory=dict)
    restoring: dict[tuple[str, str], Restoring] = field(default_factory=dict)
    runs: int = 0
    run_ms_total: float = 0.0
    slot_moves: int = 0  # sessions' KV moved to bring a batch's slots together (gather)
    # layer ranges open here, and how many loaded (or loading) stages use each
    ranges: dict[tuple[str, int, int], LayerRange] = field(default_factory=dict)
    users: dict[tuple[str, int, int], int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # stats vs the data plane
    ranges_lock: threading.Lock = field(default_factory=threading.Lock)  # loads vs unloads

    # ---- stages (event loop / worker thread) ---------------------------------------------
    def files(self, m: mf.Manifest) -> ModelFiles:
        """The model's files as this node holds them: blobs named by sha256."""
        names = {d.file: d.sha256 for e in m.files for d in e.data}

        def graph(e: mf.FileEntry) -> bytes:
            for d in e.data:
                self.blobs.verified(d.sha256, f"data file {d.file}")
            return self.blobs.verified(e.sha256, e.file).read_bytes()

        def locate(name: str) -> str:
            if name not in names:
                raise ModelFileError(f"a graph names data file {name!r}, which its manifest does not list")
            return names[name]

        return ModelFiles(self.blobs.dir, graph, locate)

    def build(self, plan_id: str, manifest_json: dict[str, Any], first: int, last: int,
              next_addr: NodeAddr | None, owner: str,
              next_capability: str | None = None, domain: str = "", address: str = "",
              max_chunk: int = 0) -> Stage:
        """Open a stage from deployed blobs (blocking: call in a thread), with a new capability,
        holding its range until `release`d; `max_chunk`: the most tokens its steps carry."""
        m = mf.parse(manifest_json, Path(self.blobs.dir))
        if not 0 <= first <= last < m.num_layers:
            raise EdgeliteError(f"load: layers {first}-{last} outside 0-{m.num_layers - 1}")
        # the files and every manifest value: a manifest that says something else about the
        # same files opens (and is checked against them) on its own
        digest = hashlib.sha256(json.dumps(m.to_json(), sort_keys=True).encode()).hexdigest()
        key = (digest, first, last)
        for e in m.layers[first:last + 1]:  # again for an open range: files can change on disk
            for d in (e, *e.data):
                self.blobs.verified(d.sha256, d.file)
        with self.ranges_lock:  # loads take turns: one range is never opened twice
            layers = self.ranges.get(key)
            if layers is None:
                scratch = max(self.scratch_bytes, own := m.scratch_for(max_chunk))
                self.limits.fits(m, first, last, self._resident(), scratch, narrow(self.runtime, m))
                layers = LayerRange(m, first, last, self.runtime, self.files(m))
                try:
                    self.limits.held(m, first, last, self._resident(), scratch)
                except EdgeliteError:
                    layers.close()
                    raise
                self.ranges[key] = layers
                self.scratch_bytes = max(self.scratch_bytes, own)
            self.users[key] = self.users.get(key, 0) + 1
        return Stage(plan_id, m, first, last, layers, next_addr, owner, secrets.token_hex(16),
                     next_capability, key, domain, address, max_chunk)

    def release(self, stage: Stage) -> None:
        """A stage no longer uses its layer range; the last user closes it."""
        key = stage.range_key
        with self.ranges_lock:
            self.users[key] = self.users.get(key, 1) - 1
            if self.users[key] > 0:
                return
            del self.users[key]
            layers = self.ranges.pop(key, None)
        if layers is not None:
            layers.close()

    def plans_of(self, owner: str) -> list[str]:
        return [p for p, s in self.stages.items() if s.owner == owner]

    def install(self, stage: Stage) -> None:
        """Make a built stage the plan's (its owner's earlier stage of that plan is unloaded).
        On the data plane's thread."""
        self.unload(stage.plan_id)
        self.stages[stage.plan_id] = stage

    def unload(self, plan_id: str) -> int:
        """Drop a plan: its sessions' KV, and its layers when no other plan uses them (the files
        stay deployed). Returns the sessions freed. On the data plane's thread."""
        stage = self.stages.pop(plan_id, None)
        if stage is None:
            return 0
        freed = [k for k in self.sessions if k[0] == plan_id]
        for k in freed:
            self._drop(k)
        self.release(stage)
        return len(freed)

    def stage_for(self, plan_id: str, fingerprint: str | None = None) -> Stage:
        """The loaded stage of a plan, refused when missing or when the connection asking was
        opened for another model."""
        stage = self.stages.get(plan_id)
        if stage is None:
            raise ProtocolError(f"plan_id {plan_id[:40]!r} is not loaded on this node")
        if fingerprint is not None and stage.manifest.fingerprint != fingerprint:
            raise ProtocolError(f"plan {stage.plan_id} serves model {stage.manifest.fingerprint}, "
                                f"this connection was opened for {fingerprint}")
        return stage

    # ---- sessions (the data plane's thread) ----------------------------------------------
    @property
    def kv_bytes(self) -> int:
        """KV held by all sessions, by capacity bucket (what they may come to hold), and by
        the slots being filled from the KV store."""
        return self.kv_bytes_of(None)

    def kv_bytes_of(self, address: str | None) -> int:
        """kv_bytes of the clients at one address (None: of all)."""
        return (sum(s.stage.layers.pool.bucket_bytes(s.slot.length) for s in self.sessions.values()
                    if address is None or s.stage.address == address)
                + sum(r.nbytes for r in self.restoring.values()
                      if address is None or r.stage.address == address))

    def prepare(self, stage: Stage, session: str, start: int, n: int) -> Session:
        """The session a step of n tokens at `start` continues (made at start 0), after
        checking its position and the node's KV budget."""
        key = (stage.plan_id, session)
        sess = self.sessions.get(key)
        have = sess.slot.length if sess else 0
        if sess is not None and have - MAX_ROLLBACK <= start < have:
            # the client took back the positions after `start` (drafts it rejected): they
            # are written over from there
            stage.layers.pool.rollback(sess.slot, start)
            have = start
        if start != have:
            raise EdgeliteError(f"session {session[:12]}: this node holds KV for {have} tokens but "
                                f"the step starts at {start} (node restarted or session expired?)")
        pool = stage.layers.pool
        self._admit(stage, session, pool.bucket_bytes(start + n) - (pool.bucket_bytes(have) if sess else 0),
                    new=sess is None)
        if sess is None:
            with self.lock:
                sess = self.sessions[key] = Session(stage, pool.acquire(), time.monotonic())
        return sess

    def _resident(self) -> int | None:
        """What this process holds now, when a memory budget asks for it."""
        return resident_bytes() if self.limits.memory_budget_bytes is not None else None

    def _admit(self, stage: Stage, session: str, grow: int, new: bool) -> None:
        """Refuse KV growth beyond the node's budgets (memory.py), or a new session beyond
        the client's."""
        self.limits.admit(session, grow, self.kv_bytes, stage.address,
                          self.kv_bytes_of(stage.address), self._resident(), self.scratch_bytes)
        if new:
            self.limits.admit_session(sum(1 for s in (*self.sessions.values(), *self.restoring.values())
                                          if s.stage.owner == stage.owner))

    def export_kv(self, plan_id: str, session: str, n: int) -> np.ndarray:
        """A copy of a session's KV of its first n positions (layers, 2, kv_heads, n, dim)."""
        sess = self.sessions.get((plan_id, session))
        if sess is None:
            raise EdgeliteError(f"session {session[:12]} holds no KV on this node")
        return sess.stage.layers.pool.read(sess.slot, n)

    def reserve(self, stage: Stage, session: str, n: int) -> Slot:
        """A new slot for a session to be filled with up to n positions from the KV store (off
        this thread), admitted within the budget, then made the session's by `attach` or freed
        by `abandon` (by whoever reserved it: nothing else frees it while it may be written).
        The session's current KV, if any, is dropped."""
        if self.stages.get(stage.plan_id) is not stage:
            raise EdgeliteError(f"plan {stage.plan_id[:12]} is not loaded")
        key = (stage.plan_id, session)
        if key in self.restoring:
            raise EdgeliteError(f"session {session[:12]} is being restored already")
        if key in self.sessions:
            self._drop(key)
        pool = stage.layers.pool
        nbytes = pool.bucket_bytes(min(n, pool.max_length))
        self._admit(stage, session, nbytes, new=True)
        slot = pool.acquire()
        with self.lock:
            self.restoring[key] = Restoring(stage, slot, nbytes)
        return slot

    def attach(self, stage: Stage, session: str, slot: Slot, n: int) -> int:
        """The reserved slot, filled with n positions, becomes the session's; returns n."""
        key = (stage.plan_id, session)
        r = self.restoring.get(key)
        if r is None or r.slot is not slot:
            raise EdgeliteError(f"session {session[:12]} has no such reserved slot")
        if self.stages.get(stage.plan_id) is not stage:  # unloaded while the entry was read
            self.abandon(stage, session, slot)
            raise EdgeliteError(f"plan {stage.plan_id[:12]} was unloaded")
        if key in self.sessions:  # (a step started it from 0 meanwhile: the stored KV wins)
            self._drop(key)
        slot.length = n
        with self.lock:
            del self.restoring[key]
            self.sessions[key] = Session(stage, slot, time.monotonic())
        return n

    def abandon(self, stage: Stage, session: str, slot: Slot) -> None:
        """A reserved slot that was not filled is freed."""
        key = (stage.plan_id, session)
        with self.lock:
            if key in self.restoring and self.restoring[key].slot is slot:
                del self.restoring[key]
        stage.layers.pool.release(slot)

    def gather(self, sessions: list[Session]) -> int:
        """Move these sessions' KV (in one slab) into neighbouring slots, from the lowest of
        theirs on: a batch runs over the span of its slots, and each slot between them would
        cost a row of compute. The sessions in the way take the places left. Nothing moves
        when a place is a slot being filled from the KV store. Returns the moves made."""
        slots = sorted((s.slot for s in sessions), key=lambda slot: slot.index)
        lo, k = slots[0].index, len(slots)
        if slots[-1].index - lo + 1 == k:
            return 0
        slab = slots[0].slab
        taken = {slot.index for slot in slots}
        holes = [j for j in range(lo, lo + k) if j not in taken]
        filling = {id(r.slot) for r in self.restoring.values()}
        if any(id(slab.slots[j]) in filling for j in holes):
            return 0
        movers = [slot for slot in slots if slot.index >= lo + k]
        pool = sessions[0].stage.layers.pool
        for slot, j in zip(movers, holes, strict=True):
            pool.swap(slot, j)
        self.slot_moves += len(movers)
        return len(movers)

    def compute(self, sess: Session, hidden: np.ndarray) -> tuple[np.ndarray, float]:
        """hidden (1, n, hidden) through the stage's layers: (its output, ms)."""
        t0 = time.perf_counter()
        out = sess.stage.layers.run(sess.slot, hidden)
        return out, self._ran(t0, sess)

    def compute_batch(self, sessions: list[Session], hidden: np.ndarray) -> tuple[np.ndarray, float]:
        """One decode token for each of several sessions of one stage, as one run."""
        t0 = time.perf_counter()
        out = sessions[0].stage.layers.run_batch([s.slot for s in sessions], hidden)
        return out, self._ran(t0, *sessions)

    def _ran(self, t0: float, *sessions: Session) -> float:
        """Count a run that started at t0 (perf_counter) and ends now; returns its ms."""
        ms = (time.perf_counter() - t0) * 1e3
        self.add_run(ms, *sessions)
        return ms

    def add_run(self, ms: float, *sessions: Session) -> None:
        """Count a run of `ms` and its sessions' last use (the decode lane does this after
        its send)."""
        now = time.monotonic()
        for s in sessions:
            s.last_used = now
        with self.lock:
            self.runs += 1
            self.run_ms_total += ms

    def end(self, plan_id: str, session: str) -> int:
        """Free a session's KV; returns the bytes freed."""
        return self._drop((plan_id, session)) if (plan_id, session) in self.sessions else 0

    def _drop(self, key: tuple[str, str]) -> int:
        with self.lock:
            sess = self.sessions.pop(key)
        pool = sess.stage.layers.pool
        freed = pool.bucket_bytes(sess.slot.length)
        pool.release(sess.slot)
        return freed

    def expire(self, ttl_s: float) -> int:
        now = time.monotonic()
        old = [k for k, s in self.sessions.items() if now - s.last_used > ttl_s]
        for k in old:
            self._drop(k)
        return len(old)

    def stats(self, owner: str | None = None, domain: str | None = None) -> dict[str, Any]:
        """The node's figures. `owner`: a client, who sees other clients' plans and sessions as
        counts, save those of its KV `domain` (its user's other processes on its device) (None:
        the node's own operator, who sees everything)."""
        with self.lock:
            sessions, kv_bytes = list(self.sessions.values()), self.kv_bytes
            runs, ms = self.runs, self.run_ms_total
        mine = {id(s): s for s in self.stages.values() if owner in (None, s.owner) or s.kv_domain == domain}
        return {"sessions": len(sessions),
                "own_sessions": sum(1 for s in sessions if id(s.stage) in mine),
                "other_plans": len(self.stages) - len(mine),
                "kv_bytes": kv_bytes, "kv_budget_bytes": self.limits.address_budget_bytes,
                "kv_node_budget_bytes": self.limits.kv_budget_bytes,
                "kv_buckets": list(self.runtime.kv_buckets), "kv_dtype": self.runtime.kv_dtype,
                "invariant": self.runtime.invariant, "provider": self.runtime.provider,
                "runs": runs, "slot_moves": self.slot_moves, "ms_per_run": ms / runs if runs else 0.0,
                "stages": [{"plan_id": s.plan_id, "model": s.layers.manifest.name,
                            "layers": [s.first, s.last], "passes": s.layers.passes,
                            "batched_decode": s.layers.batchable} for s in mine.values()]}
