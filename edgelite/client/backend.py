"""The cluster as an engine backend: a session's step goes through the plan's stages.

`open_backend` deploys a plan and returns the backend to generate with: the local engine when
the plan gives the client every layer, else a ClusterBackend (the client runs embedding, head
and its own prefix of the layers; the node stages run the rest).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import deque

import numpy as np

from edgelite.client import placements
from edgelite.client.cluster import Cluster, Progress
from edgelite.client.local import LocalBackend, restore_part, save_part
from edgelite.client.stepplane import StepPlane, StepTimeout
from edgelite.config import ClientConfig, RuntimeConfig
from edgelite.engine.runtime import ClientPart
from edgelite.errors import NodeError, NodeUnavailable
from edgelite.ids import NodeAddr, SessionId
from edgelite.manifest import Manifest
from edgelite.net.routes import Routes
from edgelite.net.steptrace import StepTrace
from edgelite.planner.model import Plan
from edgelite.reply.backend import Backend

log = logging.getLogger(__name__)


class ClusterBackend:
    """Steps through the plan's node stages (see stepplane.py for a step's life)."""

    def __init__(self, cluster: Cluster, plane: StepPlane, routes: Routes | None = None) -> None:
        self.cluster, self.plane, self.routes = cluster, plane, routes
        self.manifest = cluster.manifest
        self.placed = placements.Tracker(cluster.manifest.fingerprint)
        cluster.on_lost = self._lost
        self.heartbeat = asyncio.get_running_loop().create_task(self._heartbeat(), name="heartbeat")

    def _lost(self, addr: NodeAddr, reason: str) -> None:
        """A stage's control connection ended (e.g. the node was killed): its steps fail now,
        not at their deadline (a middle stage's loss closes no data connection of ours)."""
        if any(s.addr == addr for s in self.cluster.stages):
            self._fail_steps(addr, reason)

    def _fail_steps(self, addr: NodeAddr, reason: str) -> None:
        log.info("node %s is lost: %s", addr, reason)
        self.plane.fail_all(NodeUnavailable(f"node {addr} is lost: {reason}", node=str(addr)))

    async def _heartbeat(self) -> None:
        """Watch every stage node (see _watch); the first that goes quiet is lost."""
        stages = [s.addr for s in self.cluster.stages if s.addr is not None]
        async with asyncio.TaskGroup() as tg:
            for addr in stages:
                tg.create_task(self._watch(addr))

    async def _watch(self, addr: NodeAddr) -> None:
        """Ping the node every `heartbeat_interval_s` without waiting for the last answer; when
        no answer came for `heartbeat_timeout_s` it is lost and the steps in flight fail now.
        (One late answer, e.g. a lost packet on Wi-Fi, is covered by the next ones.)"""
        cfg = self.cluster.cfg
        last = time.monotonic()
        pings: set[asyncio.Task[None]] = set()

        def answered(task: asyncio.Task[None]) -> None:
            nonlocal last
            pings.discard(task)
            if not task.cancelled() and task.exception() is None:
                last = time.monotonic()

        try:
            while addr not in self.cluster.lost:
                task = asyncio.get_running_loop().create_task(
                    self.cluster.ping(addr, cfg.heartbeat_timeout_s))
                pings.add(task)
                task.add_done_callback(answered)
                due = time.monotonic() + cfg.heartbeat_interval_s
                await asyncio.sleep(cfg.heartbeat_interval_s)
                # time this event loop was busy elsewhere (a long parse, a tokenizer) is not
                # the node's silence: its answers may be waiting, unread, in the socket
                last += max(0.0, time.monotonic() - due)
                if time.monotonic() - last > cfg.heartbeat_timeout_s:
                    reason = f"no heartbeat answer for {cfg.heartbeat_timeout_s:g} s"
                    self.cluster.lost[addr] = reason
                    self._fail_steps(addr, reason)
        finally:
            for task in pings:
                task.cancel()
            await asyncio.gather(*pings, return_exceptions=True)

    @property
    def healthy(self) -> bool:
        """Every stage still connected and the step thread running (else `reopen`)."""
        return (not self.cluster.lost and self.plane.gone is None
                and self.plane.thread.is_alive())

    async def reopen(self) -> None:
        """Deploy the same plan again on new connections, e.g. once a restarted node is back.
        Every session is gone (its KV with it). NodeUnavailable while a node is still away;
        the backend can be reopened again later."""
        plan, token, cfg = self.plan, self.cluster.token, self.cluster.cfg
        await self.close()
        part = self.plane.part
        part.reset()
        self.cluster, self.plane = await _deploy(self.manifest, plan, token, cfg, part, self.routes)
        self.cluster.on_lost = self._lost
        self.heartbeat = asyncio.get_running_loop().create_task(self._heartbeat(), name="heartbeat")

    @property
    def plan(self) -> Plan:
        assert self.cluster.plan is not None
        return self.cluster.plan

    @property
    def traces(self) -> deque[StepTrace]:
        """Recent steps' timings (per stage, and the round trip)."""
        return self.plane.traces

    async def forward(self, session: str, ids: np.ndarray) -> np.ndarray:
        self._check_lost()
        try:
            return await self.plane.forward(SessionId(session), ids)
        except StepTimeout as exc:
            raise await self._diagnose(exc) from None

    @property
    def context(self) -> int:
        """The model's context, or less where the client's own layers hold less (a node that
        holds less refuses the step that would go past it)."""
        part = self.plane.part
        m = part.manifest
        return min(m.max_positions, part.prefix.pool.max_length if part.prefix else m.max_positions)

    @property
    def step_compute_ms(self) -> float | None:
        """The node stages' compute in the last step (its trace)."""
        traces = self.plane.traces
        return sum(c for c, _ in traces[-1].stages) / 1e3 if traces else None

    async def verify(self, session: str, ids: np.ndarray) -> np.ndarray:
        self._check_lost()
        try:
            return await self.plane.forward(SessionId(session), ids, every=True)
        except StepTimeout as exc:
            raise await self._diagnose(exc) from None

    async def hidden(self, session: str, ids: np.ndarray) -> np.ndarray:
        self._check_lost()
        try:
            return await self.plane.forward(SessionId(session), ids, every=True, normed=True)
        except StepTimeout as exc:
            raise await self._diagnose(exc) from None

    async def rollback(self, session: str, n: int) -> None:
        await self.plane.rollback(SessionId(session), n)

    def _check_lost(self) -> None:
        lost = [a for a in (s.addr for s in self.cluster.stages) if a in self.cluster.lost]
        if lost:
            raise NodeUnavailable(f"node {lost[0]} is gone ({self.cluster.lost[lost[0]]})",
                                  node=str(lost[0]))

    async def _diagnose(self, timeout: StepTimeout) -> NodeUnavailable:
        """Name the first stage that does not answer a ping."""
        ping_timeout = max(0.2, self.cluster.cfg.step_timeout_s / 2)
        for s in self.cluster.stages:
            assert s.addr is not None
            try:
                await self.cluster.ping(s.addr, ping_timeout)
            except NodeError:
                self.cluster.lost[s.addr] = "stalled"
                return NodeUnavailable(f"node {s.addr} (layers {s.first}-{s.last}) stalled: "
                                       f"{timeout}", node=str(s.addr))
        return NodeUnavailable(f"a step got {timeout} although every stage answers pings")

    async def end(self, session: str) -> None:
        await self.plane.end(SessionId(session))
        await self.cluster.end(SessionId(session))

    async def restore(self, session: str, tokens: list[int]) -> int:
        """Every part (the client's layers, each node stage) imports the longest prefix of
        `tokens` its KV store holds; when they differ, all import the shortest of them (or
        nothing, if that fails). Where the plan that stored the conversation last split the
        model otherwise, each part takes its layers from where that plan held them
        (placements.py)."""
        newest = await self.placed.newest()
        lengths = await self._restore(session, tokens, False, newest)
        n = min(lengths)
        if n and any(x != n for x in lengths):
            lengths = await self._restore(session, tokens[:n], True, newest)
        if not n or any(x != n for x in lengths):
            if any(lengths):
                await self.end(session)
            return 0
        await self.plane.start_at(SessionId(session), n)
        return n

    async def _restore(self, session: str, tokens: list[int], exact: bool,
                       newest: placements.Placement | None) -> list[int]:
        raw = np.asarray(tokens, "<i4").tobytes()
        nodes = self.cluster.kv_restore(
            SessionId(session), raw, exact,
            lambda s: placements.sources(newest, placements.Span(s.addr, s.first, s.last)))
        if self.plane.part.prefix is None:
            return await nodes
        mine = restore_part(self.plane.part, session, tokens, self.plane.submit, exact)
        local, remote = await asyncio.gather(mine, nodes)
        return [local, *remote]

    async def save(self, session: str, tokens: list[int], behind: bool = False) -> int:
        raw = np.asarray(tokens, "<i4").tobytes()
        mine = save_part(self.plane.part, session, tokens, self.plane.submit, behind)
        local, remote = await asyncio.gather(mine, self.cluster.kv_save(SessionId(session), raw, behind))
        if local + remote and (plan := self.cluster.plan) is not None:
            await self.placed.saved(tuple(placements.Span(s.addr, s.first, s.last)
                                          for s in plan.stages))
        return local + remote

    async def close(self) -> None:
        self.cluster.on_lost = lambda _a, _r: None  # our own closing is no loss
        self.heartbeat.cancel()
        await asyncio.gather(self.heartbeat, return_exceptions=True)
        await self.plane.stop()
        await self.cluster.close()
        self.plane.part.close()  # (the thread that used it has stopped)


async def _deploy(manifest: Manifest, plan: Plan, token: str, cfg: ClientConfig, part: ClientPart,
                  routes: Routes | None, progress: Progress | None = None) -> tuple[Cluster, StepPlane]:
    """Deploy the plan's node stages and start the step plane that drives them with `part`."""
    cluster = Cluster(manifest, token, cfg)
    try:
        sockets = await cluster.deploy(plan, routes, progress)
        assert sockets is not None
        stages = plan.remote
        pr = plan.predicted
        plane = StepPlane(asyncio.get_running_loop(), part, cluster.plan_id,
                          stages[0].addr, stages[-1].addr, len(stages), cfg,  # type: ignore[arg-type]
                          cluster.limits, pr.expected if pr is not None and math.isfinite(pr.expected)
                          else pr.total if pr is not None else 0.0)
        plane.start()
        plane.attach(*sockets)
    except BaseException:
        await cluster.close()
        raise
    return cluster, plane


async def open_backend(manifest: Manifest, plan: Plan, token: str | None,
                       cfg: ClientConfig | None = None, runtime: RuntimeConfig | None = None,
                       routes: Routes | None = None, progress: Progress | None = None) -> Backend:
    """Deploy `plan` and return a backend to generate with (prompts in chunks of at most
    the plan's `max_chunk`, where memory allowed no larger)."""
    cfg, runtime = cfg or ClientConfig(), runtime or RuntimeConfig()
    if plan.max_chunk:
        runtime = dataclasses.replace(runtime, prefill_chunks=tuple(
            c for c in runtime.prefill_chunks if c <= plan.max_chunk) or (plan.max_chunk,))
    if not plan.remote:
        return LocalBackend(manifest, runtime)
    if token is None:
        raise NodeError("the cluster token is needed to reach the nodes: --token or "
                        "EDGELITE_TOKEN (each node prints it when it starts)")
    local = plan.local
    part = await asyncio.to_thread(ClientPart, manifest, runtime,
                                   (local.first, local.last) if local else None)
    cluster, plane = await _deploy(manifest, plan, token, cfg, part, routes, progress)
    return ClusterBackend(cluster, plane, routes)
