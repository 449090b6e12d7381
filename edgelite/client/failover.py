"""Failover: a backend that outlives the nodes it runs on.

It keeps every live session's token history (the client holds every id anyway). When a step
fails because a node was lost (its connection closed, it stopped answering heartbeats, or a
step timed out and it does not answer a ping), it:

1. finds which stage nodes are gone (`detect`: ping each, `heartbeat_timeout_s`);
2. plans again without them (`plan`: the last probe minus the lost nodes, so no new
   measurement is needed; a fixed split is spread evenly over the nodes left);
3. deploys the new plan (`deploy`; the files a node lacks are uploaded) after closing the old;
4. rebuilds the KV of each session at its next step by replaying its steps through the new
   stages first, in the shapes they first ran in (`rebuild`), and goes on with the same
   generation: the ids are those of an uninterrupted run.

A node that a recovery left out and that answers again (asked every `rejoin_interval_s` by
`rejoin`, which the gateway calls between rounds) is planned in again the same way, as is any
node at the next recovery or the next `connect`. If the nodes left cannot hold the model, the
planner's error says how much memory is short.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from edgelite.config import ClientConfig
from edgelite.errors import EdgeliteError, NodeError
from edgelite.ids import NodeAddr
from edgelite.manifest import Manifest
from edgelite.planner.model import Plan
from edgelite.reply.backend import Backend

log = logging.getLogger(__name__)

# (nodes to leave out) -> a backend deployed on the others, ms to plan, ms to deploy
Replan = Callable[[frozenset[NodeAddr]], Awaitable[tuple[Backend, float, float]]]
Answers = Callable[[NodeAddr], Awaitable[bool]]  # whether a node answers (a handshake) now


@dataclass
class Recovery:
    """One failover, timed (ms); `detected_at`: time.monotonic() when the loss surfaced."""

    lost: list[str]
    reason: str
    detected_at: float
    detect_ms: float = 0.0
    plan_ms: float = 0.0
    deploy_ms: float = 0.0
    rebuild_ms: float = 0.0  # the first step after it: history of that session + its ids
    plan: str = ""
    back: list[str] = field(default_factory=list)  # nodes planned in again (a rejoin, not a loss)

    def summary(self) -> str:
        what = (f"{', '.join(self.back)} answer again" if self.back
                else f"lost {', '.join(self.lost) or 'a connection'}")
        return (f"{what}; going on with {self.plan} (detect {self.detect_ms:.0f} ms, plan "
                f"{self.plan_ms:.0f} ms, deploy {self.deploy_ms:.0f} ms)")


@dataclass(frozen=True)
class Past:
    """One thing a session did to its KV, replayed in order on new stages."""

    ids: np.ndarray | None  # a step's ids (None: a rollback)
    every: bool = False  # the step was a verification (Backend.verify: one run, every position)
    normed: bool = False  # ... for the final norm's output (Backend.hidden)
    keep: int = 0  # a rollback's positions kept


@dataclass
class _Sessions:
    # what each session has run, replayed in order on new stages: the same shapes give the
    # same KV to the last bit, so the ids go on exactly as they would have
    history: dict[str, list[Past]] = field(default_factory=dict)
    stale: set[str] = field(default_factory=set)  # KV to rebuild at their next step


class FailoverBackend:
    """A Backend (see reply/generate.py) over a replaceable inner backend."""

    def __init__(self, manifest: Manifest, inner: Backend, replan: Replan, cfg: ClientConfig,
                 answers: Answers | None = None) -> None:
        self.manifest, self.inner, self.replan, self.cfg = manifest, inner, replan, cfg
        self.answers = answers
        self.s = _Sessions()
        self.generation = 0  # recoveries so far
        self.lock = asyncio.Lock()
        self.recoveries: list[Recovery] = []
        self.left_out: frozenset[NodeAddr] = frozenset()  # what the last recovery planned without
        self.next_rejoin = 0.0  # (monotonic) when to ask them again
        # why the last recovery found no plan (the old stages closed: every step fails with it
        # until a recovery works); the nodes it had then, asked afresh each time
        self.failed: EdgeliteError | None = None
        self.planned: list[NodeAddr] = []

    @property
    def plan(self) -> Plan | None:
        """The plan steps run on now (None: the local engine)."""
        plan = getattr(self.inner, "plan", None)
        return plan if isinstance(plan, Plan) else None

    @property
    def healthy(self) -> bool:
        return self.failed is None and self.inner.healthy

    @property
    def step_compute_ms(self) -> float | None:
        return self.inner.step_compute_ms

    @property
    def context(self) -> int:
        return self.inner.context

    async def reopen(self) -> None:
        """(The gateway after a loss it saw between steps.) Recover now; every session's KV
        is rebuilt from its history at its next step."""
        await self._recover(self.generation, "the gateway found the backend unhealthy")

    async def forward(self, session: str, ids: np.ndarray) -> np.ndarray:
        return await self._run(session, Past(ids))

    async def verify(self, session: str, ids: np.ndarray) -> np.ndarray:
        return await self._run(session, Past(ids, every=True))

    async def hidden(self, session: str, ids: np.ndarray) -> np.ndarray:
        return await self._run(session, Past(ids, every=True, normed=True))

    async def rollback(self, session: str, n: int) -> None:
        if session not in self.s.stale:  # (a stale one is rolled back in its replay)
            await self.inner.rollback(session, n)
        self.s.history.setdefault(session, []).append(Past(None, keep=n))

    async def _replay(self, session: str, past: Past) -> np.ndarray | None:
        if past.ids is None:
            await self.inner.rollback(session, past.keep)
            return None
        if past.normed:
            return await self.inner.hidden(session, past.ids)
        if past.every:
            return await self.inner.verify(session, past.ids)
        return await self.inner.forward(session, past.ids)

    async def _run(self, session: str, now: Past) -> np.ndarray:
        failovers = 0
        pending: Recovery | None = None
        while True:
            if self.failed is not None:
                raise self.failed  # (the planner's reason, not the closed stages' own)
            gen = self.generation
            t0 = time.perf_counter()
            try:
                if session in self.s.stale:
                    for past in self.s.history.get(session, []):
                        await self._replay(session, past)
                    self.s.stale.discard(session)
                logits = await self._replay(session, now)
                assert logits is not None
            except NodeError as exc:
                if not self.cfg.failover or failovers >= self.cfg.max_failovers:
                    raise
                if self.generation != gen:  # another step recovered while this one failed
                    failovers += 1
                    continue
                if not await self._lost_something():
                    raise  # a step's own error, every node fine: not ours to hide
                failovers += 1
                pending = await self._recover(gen, str(exc))
                continue
            if pending is not None:  # this step ran the session again on the new stages
                pending.rebuild_ms = (time.perf_counter() - t0) * 1e3
            self.s.history.setdefault(session, []).append(now)
            return logits

    async def _lost_something(self) -> bool:
        """A stage node gone or not answering, or the inner backend broken."""
        if not self.inner.healthy:
            return True
        return bool(await self._gone())

    async def _gone(self) -> dict[NodeAddr, str]:
        if self.failed is not None:  # (the stages are closed: each node asked afresh)
            return await self._unanswered(self.planned)
        cluster = getattr(self.inner, "cluster", None)
        if cluster is None:
            return {}
        gone = dict(cluster.lost)
        stages = [s.addr for s in cluster.stages if s.addr is not None and s.addr not in gone]
        self.planned = [*stages, *gone]
        answers = await asyncio.gather(*(cluster.ping(a, self.cfg.heartbeat_timeout_s)
                                         for a in stages), return_exceptions=True)
        for addr, answer in zip(stages, answers, strict=True):
            if isinstance(answer, EdgeliteError):
                gone[addr] = str(answer)
            elif isinstance(answer, BaseException):
                raise answer
        return gone

    async def _unanswered(self, addrs: list[NodeAddr]) -> dict[NodeAddr, str]:
        if self.answers is None:
            return {a: "lost" for a in addrs}
        answered = await asyncio.gather(*(self.answers(a) for a in addrs))
        return {a: "does not answer" for a, ok in zip(addrs, answered, strict=True) if not ok}

    async def rejoin(self) -> Recovery | None:
        """Plan the nodes the last recovery left out in again, if they answer now (asked at
        most every `rejoin_interval_s`); the sessions go on as after a recovery."""
        now = time.monotonic()
        if not self.left_out or self.answers is None or now < self.next_rejoin:
            return None
        self.next_rejoin = now + self.cfg.rejoin_interval_s
        out = list(self.left_out)
        silent = await self._unanswered(out)
        back = [a for a in out if a not in silent]
        if not back:
            return None
        async with self.lock:
            log.info("%s answer again; planning them in", ", ".join(map(str, back)))
            return await self._switch(self.left_out - set(back), f"{len(back)} node(s) back", now, back)

    async def _recover(self, gen: int, reason: str) -> Recovery | None:
        async with self.lock:
            if self.generation != gen:
                return None  # another step recovered meanwhile
            t0 = time.monotonic()
            gone = await self._gone()
            log.info("lost %s (%s); planning again without it", ", ".join(map(str, gone)) or
                        "a stage connection", reason)
            return await self._switch(frozenset(gone), reason, t0)

    async def _switch(self, gone: frozenset[NodeAddr], reason: str, t0: float,
                      back: Sequence[NodeAddr] = ()) -> Recovery:
        """Deploy a plan without `gone` (the caller holds the lock; `back`: the nodes it plans
        in again); every session is rebuilt at its next step."""
        rec = Recovery([str(a) for a in gone], reason, t0, back=[str(a) for a in back])
        rec.detect_ms = (time.monotonic() - t0) * 1e3
        await self.inner.close()
        gc.collect()  # (the old plan's client part goes before the next one loads)
        try:
            self.inner, rec.plan_ms, rec.deploy_ms = await self.replan(gone)
        except EdgeliteError as exc:  # (no plan without them: every step says why, until one works)
            lost = ", ".join(map(str, gone)) or "a stage connection"
            self.failed = EdgeliteError(f"lost {lost}, and {exc}")
            raise self.failed from exc
        self.failed = None
        self.left_out = gone
        self.next_rejoin = time.monotonic() + self.cfg.rejoin_interval_s
        plan = self.plan
        rec.plan = ("the local engine" if plan is None or not plan.remote else " -> ".join(
            f"{s.device} [{s.first}-{s.last}]" for s in plan.stages))
        self.s.stale = set(self.s.history)
        self.generation += 1
        self.recoveries.append(rec)
        log.warning("%s", rec.summary())
        return rec

    async def end(self, session: str) -> None:
        self.s.history.pop(session, None)
        if self.failed is not None:  # (the stages are closed: nothing of it is held anywhere)
            self.s.stale.discard(session)
            return
        if session in self.s.stale:  # nothing of it on the new stages yet
            self.s.stale.discard(session)
            return
        await self.inner.end(session)

    async def restore(self, session: str, tokens: list[int]) -> int:
        if self.failed is not None:
            raise self.failed
        n = await self.inner.restore(session, tokens)
        if n:  # rebuilt by computing them, should the stages go
            self.s.history[session] = [Past(np.array([tokens[:n]], np.int64))]
        return n

    async def save(self, session: str, tokens: list[int], behind: bool = False) -> int:
        if session in self.s.stale or self.failed is not None:
            return 0
        return await self.inner.save(session, tokens, behind)

    async def close(self) -> None:
        await self.inner.close()
