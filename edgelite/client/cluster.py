"""The client's side of a deployed plan: control links to its nodes, the deploy, the data
connections (handed to the step plane), freeing sessions, stats.

Control requests (deploy, load, stats, end) use one connection per node, on the event loop.
Steps use two data connections per plan, owned by the step plane's thread (stepplane.py): `in` to
the first node stage, whose data plane passes each step along the chain, and `sink` from the
last stage, on which the results come back.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from collections.abc import Callable

from edgelite import paths
from edgelite.config import ClientConfig, WireLimits
from edgelite.errors import AuthError, EdgeliteError, NodeError, NodeUnavailable
from edgelite.ids import NodeAddr, PlanId, SessionId, new_plan_id
from edgelite.manifest import Manifest
from edgelite.net import messages as m
from edgelite.net.frames import detach
from edgelite.net.handshake import connect
from edgelite.net.link import NodeLink
from edgelite.net.routes import Routes, route
from edgelite.net.upload import push_files
from edgelite.planner.model import Plan, Stage

log = logging.getLogger(__name__)
Progress = Callable[[str, int, int], None]


class Cluster:
    """Connections to the nodes of one plan (created by `deploy`)."""

    def __init__(self, manifest: Manifest, token: str, cfg: ClientConfig | None = None,
                 limits: WireLimits | None = None) -> None:
        self.manifest, self.token = manifest, token
        self.cfg, self.limits = cfg or ClientConfig(), limits or WireLimits()
        self.links: dict[NodeAddr, NodeLink] = {}
        self.plan: Plan | None = None
        self.plan_id: PlanId = new_plan_id()
        # this client's key (Auth.client): its connections to a node are one owner there
        self.client_key = secrets.token_hex(16)
        # its KV's key on the nodes (Auth.kv): kept across restarts, its own KV only
        self.kv_key = paths.kv_key() or self.client_key
        self.capabilities: dict[NodeAddr, str] = {}  # what opens each stage's data connections
        self.lost: dict[NodeAddr, str] = {}  # nodes whose control connection ended, and why
        self.on_lost: Callable[[NodeAddr, str], None] = lambda _a, _r: None

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The plan's node stages, in chain order."""
        return self.plan.remote if self.plan else ()

    async def connect(self, addrs: list[NodeAddr]) -> None:
        for addr in addrs:
            if addr not in self.links:
                self.links[addr] = await NodeLink.open(addr, self.token, self.manifest.fingerprint,
                                                       self.limits, self.cfg.connect_timeout_s,
                                                       self._lost, self.client_key, self.kv_key,
                                                       self.cfg.local_host)

    def _lost(self, link: NodeLink, reason: str) -> None:
        self.lost[link.addr] = reason
        self.on_lost(link.addr, reason)

    def link(self, addr: NodeAddr) -> NodeLink:
        return self.links[addr]

    async def deploy(self, plan: Plan, routes: Routes | None = None,
                     progress: Progress | None = None) -> tuple[socket.socket, socket.socket] | None:
        """Send each node stage the layer files it needs (skipping what it holds), then load
        the plan, last stage first (each connects onward to the next, over `routes`). Returns
        the plan's data sockets (in, sink), or None when the client runs every layer."""
        if self.plan is not None:
            raise EdgeliteError("this cluster has deployed its plan already; open another one")
        stages = plan.remote
        if len({s.addr for s in stages}) != len(stages):
            raise EdgeliteError("a node appears in two stages of one plan")
        await self.connect([s.addr for s in stages if s.addr is not None])
        for s in stages:
            assert s.addr is not None
            await push_files(self.links[s.addr], self.manifest.root,
                             self.manifest.layers[s.first:s.last + 1], self.cfg.deploy_chunk_bytes,
                             self.cfg.deploy_timeout_s, progress)
        for i in reversed(range(len(stages))):
            s = stages[i]
            nxt, nxt_cap = None, None
            if i + 1 < len(stages):
                nxt = route(routes or {}, s.addr, stages[i + 1].addr)  # type: ignore[arg-type]
                nxt_cap = self.capabilities[stages[i + 1].addr]  # type: ignore[index]
            loaded = await self.links[s.addr].request(  # type: ignore[index]
                m.Load(id=0, plan_id=self.plan_id, first=s.first, last=s.last, next=nxt,
                       manifest=self.manifest.to_json(), next_capability=nxt_cap,
                       max_chunk=plan.max_chunk), m.Loaded,
                self.cfg.deploy_timeout_s)
            self.capabilities[s.addr] = loaded.capability  # type: ignore[index]
        self.plan = plan
        if not stages:
            return None
        sink = await self._data_socket(stages[-1].addr, "sink")  # type: ignore[arg-type]
        try:
            data_in = await self._data_socket(stages[0].addr, "in")  # type: ignore[arg-type]
        except BaseException:
            sink.close()
            raise
        return data_in, sink

    async def _data_socket(self, addr: NodeAddr, role: str) -> socket.socket:
        """A connection the node hands to its data plane (role in: steps; sink: results), taken
        off this event loop for the step plane."""
        try:
            conn, _ = await connect(addr, self.token, self.manifest.fingerprint, self.limits,
                                    self.cfg.connect_timeout_s, client=self.client_key,
                                    local_host=self.cfg.local_host)
        except (ConnectionError, AuthError) as exc:
            raise NodeUnavailable(f"node {exc}", node=str(addr)) from exc
        try:
            await conn.send(m.OpenData(id=0, plan_id=self.plan_id, role=role,  # type: ignore[arg-type]
                                       capability=self.capabilities[addr]))
            reply = await asyncio.wait_for(conn.recv(), self.cfg.request_timeout_s)
            if isinstance(reply, m.Error):
                raise NodeError(f"node {addr}: {reply.message}", node=str(addr))
            if not isinstance(reply, m.DataReady):
                raise NodeError(f"node {addr}: answered data with {reply.TYPE}", node=str(addr))
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError) as exc:
            await conn.close()
            raise NodeUnavailable(f"node {addr}: no data connection: {exc!r}", node=str(addr)) from exc
        except BaseException:
            await conn.close()
            raise
        return detach(conn.writer)

    async def end(self, session: SessionId) -> None:
        """Free the session's KV on every stage still answering (best effort)."""
        live = [self.links[s.addr] for s in self.stages if s.addr not in self.lost]  # type: ignore[index]
        end = m.EndSession(id=0, plan_id=self.plan_id, session=session)
        await asyncio.gather(*(link.request(end, m.Ended, self.cfg.end_timeout_s) for link in live),
                             return_exceptions=True)

    async def _each_stage(self, req: Callable[[Stage], m.Message], reply: type[m.Message],
                          live_only: bool) -> list:
        """`req(stage)` to every stage (or those not lost) at once: each one's reply, or None
        where the node refused it or is unreachable (logged); the KV stores are best effort."""
        stages = [s for s in self.stages if not live_only or s.addr not in self.lost]
        reqs = [req(s) for s in stages]
        answers = await asyncio.gather(*(
            self.links[s.addr].request(r, reply, self.cfg.kv_store_timeout_s)  # type: ignore[index]
            for s, r in zip(stages, reqs, strict=True)), return_exceptions=True)
        for s, r, a in zip(stages, reqs, answers, strict=True):
            if isinstance(a, EdgeliteError):
                log.info("node %s: %s: %s", s.addr, r.TYPE, a)
            elif isinstance(a, BaseException):
                raise a
        return [a if isinstance(a, reply) else None for a in answers]

    async def kv_restore(self, session: SessionId, tokens: bytes, exact: bool,
                         sources: Callable[[Stage], list[m.KvSource]] = lambda _s: []) -> list[int]:
        """Each stage's length after starting the session from its KV store (0 where it has
        nothing, or refused); `sources`: where each stage's layers were stored when another
        plan held them (KvRestore.sources)."""
        return [a.length if a else 0 for a in await self._each_stage(
            lambda s: m.KvRestore(id=0, plan_id=self.plan_id, session=session, tokens=tokens,
                                  exact=exact, sources=sources(s)), m.KvRestored, False)]

    async def kv_save(self, session: SessionId, tokens: bytes, behind: bool = False) -> int:
        """Store the session's KV on every stage; the bytes stored (best effort; `behind`:
        KvSave.behind)."""
        req = m.KvSave(id=0, plan_id=self.plan_id, session=session, tokens=tokens, behind=behind)
        return sum(a.bytes for a in await self._each_stage(lambda _s: req, m.KvSaved, True) if a)

    async def ping(self, addr: NodeAddr, timeout_s: float) -> None:
        await self.links[addr].request(m.Ping(id=0), m.Pong, timeout_s)

    async def stats(self) -> dict[NodeAddr, dict]:
        """The stats of each connected node that answers (one lost or silent is left out: the
        others' still come)."""
        addrs = list(self.links)
        replies = await asyncio.gather(*(self.links[a].request(m.StatsRequest(id=0), m.StatsReply,
                                                                self.cfg.request_timeout_s)
                                         for a in addrs), return_exceptions=True)
        out = {}
        for addr, reply in zip(addrs, replies, strict=True):
            if isinstance(reply, m.StatsReply):
                out[addr] = reply.stats
            elif isinstance(reply, EdgeliteError | OSError | TimeoutError):
                log.info("node %s gave no stats: %s", addr, reply)
            elif isinstance(reply, BaseException):
                raise reply
        return out

    async def close(self) -> None:
        await asyncio.gather(*(link.close() for link in self.links.values()))
