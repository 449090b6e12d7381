"""The stage node: an asyncio TCP server holding layer ranges, per-session KV, deployed files.

Control requests are served on the event loop, one typed message each (net/messages.py), by
control.py, and answered by concern: deploy.py (files, model folders, plans), sessions.py
(ending sessions, storing and restoring their KV), measure.py (pings, profiles, link probes);
stats here. A connection that asks for `data` is handed to the data plane
(dataplane.py): one thread that reads steps, runs the stage's layers and writes each result
straight on to the next stage (or, from the last stage, to the plan's client). A bad frame costs
its sender an error reply, never the node or another session.

Ownership: a client is its key (Auth.client; without one, its connection). A plan belongs to
the client that loaded it: `load` answers with the plan's capability, which every data
connection of the plan must present; other clients cannot load over the plan, end its
sessions or see it in stats (only counts). When a client's last control connection has been
closed for `owner_grace_s`, its plans are unloaded (their files stay).

Housekeeping (one task, every `supervise_s`): the data plane's thread is restarted if it died,
orphaned plans are unloaded, idle sessions expire, abandoned partial uploads are deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import platform
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from edgelite.config import NodeConfig, WireLimits
from edgelite.engine import kernels
from edgelite.engine.profile import peak_resident_bytes, resident_bytes
from edgelite.errors import AuthError, EdgeliteError, ProtocolError
from edgelite.ids import NodeAddr
from edgelite.net import messages as m
from edgelite.net.admission import Admission
from edgelite.net.budget import ByteBudget
from edgelite.net.discovery import respond
from edgelite.net.frames import Conn, bound_port, detach, listen, pack
from edgelite.net.handshake import server_handshake
from edgelite.net.linkprobe import UdpEcho
from edgelite.node.blobs import BlobStore
from edgelite.node.control import Control, try_send
from edgelite.node.dataplane import DataPlane
from edgelite.node.deploy import Deploy
from edgelite.node.measure import Measure
from edgelite.node.memory import Limits
from edgelite.node.sessions import Sessions
from edgelite.node.shelf import Shelf
from edgelite.node.stages import StageStore, files_in_use, kv_domain

log = logging.getLogger(__name__)
PART_SWEEP_S = 60.0  # how often abandoned partial uploads are looked for (at most)


@dataclass(frozen=True)
class Client:
    """A connected client key, as the node knows it."""

    kv_domain: str  # whose KV its sessions store and restore (stages.kv_domain)
    address: str  # where it connected from (its address's share of the KV budget)


@dataclass
class Node:
    cfg: NodeConfig
    token: str
    data_dir: Path
    name: str = field(default_factory=platform.node)
    limits: WireLimits = field(default_factory=WireLimits)

    def __post_init__(self) -> None:
        c = self.cfg
        blobs = BlobStore(self.data_dir, c.max_file_bytes, c.disk_quota_bytes, c.part_ttl_s,
                          c.blob_grace_s)
        self.store = StageStore(blobs, Limits(c.kv_budget_bytes, c.memory_budget_bytes,
                                              c.max_address_kv_share, c.max_sessions_per_client),
                                c.runtime)
        blobs.pinned = lambda: files_in_use(self.store.stages)  # never deleted
        self.shelf = Shelf(self.data_dir, blobs)  # model folders pushed here (edgelite push)
        self.data = DataPlane(self.name, self.store, c, self.limits)
        self.server: asyncio.Server | None = None
        self.conns: set[Conn] = set()  # open client connections, closed on shutdown
        self.handlers: set[asyncio.Task[None]] = set()  # their handler tasks (owned by the server)
        self.bad_handshakes = 0
        self.restarts = 0  # data plane threads restarted after dying
        self.udp: asyncio.DatagramTransport | None = None
        self.discovery: asyncio.DatagramTransport | None = None  # answers `--nodes auto`
        self.udp_port = 0
        self.owners: dict[str, int] = {}  # client key -> its open control connections
        self.frame_budget = ByteBudget(c.max_held_frame_bytes)  # requests' frames, all connections
        self.admission = Admission.of(c)
        self.clients: dict[str, Client] = {}  # client key -> whose KV, from where
        self.orphaned: dict[str, float] = {}  # owners of plans with no connection, since when
        # the requests by concern: sessions and their KV, what is deployed, measurements
        self.sessions = Sessions(self.store, c, self.token, self.limits, lambda: self.data)
        self.deploy = Deploy(self.store, self.shelf, c, self.token, self.limits, lambda: self.data,
                             self._client)
        self.measure = Measure(self.name, self.store, c, self.token, lambda: self.data)
        se, de, me = self.sessions, self.deploy, self.measure
        self.control = Control(c, self.limits, {
            m.Ping: me.ping, m.Bulk: me.bulk, m.ProfileRequest: me.profile,
            m.ProbeLink: me.probe_link, m.StatsRequest: self._stats,
            m.FilesQuery: de.files, m.Upload: de.upload, m.ModelPut: de.model_put, m.Load: de.load,
            m.ModelsQuery: de.models, m.ModelRemove: de.model_rm, m.BlobsCollect: de.blobs_gc,
            m.EndSession: se.end, m.KvSave: se.kv_save, m.KvRestore: se.kv_restore,
            m.KvExport: se.kv_export, m.KvExportRead: se.kv_export_read},
            me.ping, self._data, self.frame_budget)

    @property
    def bad_frames(self) -> int:
        """Handshakes and requests refused (the data plane counts its own)."""
        return self.bad_handshakes + self.control.bad_frames

    @property
    def port(self) -> int:
        return bound_port(self.server)

    @property
    def addr(self) -> NodeAddr:
        return NodeAddr(self.cfg.host, self.port)

    async def start(self) -> None:
        await self.sessions.open(self.data_dir)
        self.server = await listen(self._handle, self.cfg.host, self.cfg.port)
        runtime = self.cfg.runtime
        if runtime.attention_kernel or runtime.matmul_kernel:  # (in its own thread: nothing waits on it)
            kernels.start(runtime)
            log.info("building edgelite's kernel library for this CPU in the background")
        loop = asyncio.get_running_loop()
        try:  # the UDP echo for loss probes shares the TCP port number when it is free
            self.udp, _ = await loop.create_datagram_endpoint(
                lambda: UdpEcho(self.token), local_addr=(self.cfg.host, self.port))
        except OSError:
            self.udp, _ = await loop.create_datagram_endpoint(
                lambda: UdpEcho(self.token), local_addr=(self.cfg.host, 0))
        self.udp_port = self.udp.get_extra_info("sockname")[1]
        if self.cfg.discovery_port:
            self.discovery = await respond(self.token, self.cfg.discovery_port, self.port,
                                           self.cfg.host, self.name)
        self.data.start()

    async def run(self) -> None:
        """Serve until cancelled: the server and the session reaper (the data plane runs in its
        thread). On the way out every connection is closed and its handler has finished."""
        if self.server is None:
            await self.start()
        assert self.server is not None
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._housekeeping())
                tg.create_task(self.server.serve_forever())
        finally:
            await self.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.udp is not None:
            self.udp.close()
        if self.discovery is not None:
            self.discovery.close()
        for conn in self.conns:
            conn.writer.close()
        handlers = [t for t in self.handlers if t is not asyncio.current_task()]
        if handlers:
            await asyncio.wait(handlers, timeout=self.cfg.shutdown_timeout_s)
        self.measure.close()
        await self.sessions.stop_restores()
        await self.data.stop()
        await self.sessions.close()

    # ---- connections -------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = writer.get_extra_info("peername")[:2]
        conn = Conn(reader, writer, self.limits, f"{host}:{port}")
        c = self.cfg
        refused = self.admission.arrive(host)
        if refused is not None:
            if refused.budget == "strangers":  # (closed unanswered: a flood costs little)
                log.debug("%s: refused before the handshake: %s", conn.peer, refused.why)
            else:
                log.warning("%s: refused: %s", conn.peer, refused.why)
                await try_send(conn, m.Error(message=f"this node refused the connection: {refused.why}; "
                                                     "try later"))
            await conn.close()
            return
        me = asyncio.current_task()
        if me is not None:
            self.handlers.add(me)
        owner, stranger = None, True
        try:
            fps = sorted({s.manifest.fingerprint for s in self.store.stages.values()})
            auth = await asyncio.wait_for(
                server_handshake(conn, self.token, self.name, fps, self.port, self.udp_port),
                c.handshake_timeout_s)
            self.admission.authenticated(host)
            stranger = False
            self.conns.add(conn)
            owner = auth.client or f"anon{secrets.token_hex(16)}"  # (logs show its first 8: anon + 4 hex)
            self.clients[owner] = Client(kv_domain(auth.kv or owner), host)
            self.owners[owner] = self.owners.get(owner, 0) + 1
            if self.owners[owner] == 1:
                log.info("client %s connected from %s", owner[:8], host)
            self.orphaned.pop(owner, None)
            await self.control.serve(conn, auth.fingerprint, owner)
        except (AuthError, ProtocolError) as exc:
            self.bad_handshakes += 1
            log.warning("%s: %s; closing", conn.peer, exc)
            await try_send(conn, m.Error(message=str(exc)))
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            log.debug("%s: connection ended: %r", conn.peer, exc)
        finally:
            self.admission.leave(host, not stranger)
            if owner is not None:
                self.owners[owner] -= 1
                if not self.owners[owner]:
                    del self.owners[owner]
                    log.info("client %s left", owner[:8])
                    self.clients.pop(owner, None)
                    self.sessions.exports.drop(owner)
            self.conns.discard(conn)
            self.handlers.discard(me)  # type: ignore[arg-type]
            await conn.close()

    async def _data(self, conn: Conn, msg: m.OpenData, fingerprint: str | None) -> bool:
        """Hand this connection to the data plane: `in` carries steps into this node, `sink`
        takes a plan's results back to its client. False: the connection stays here."""
        stage = self.store.stage_for(msg.plan_id, fingerprint)
        if not hmac.compare_digest(stage.capability.encode(), msg.capability.encode()):
            raise ProtocolError(f"data: wrong capability for plan {msg.plan_id[:12]}")
        if conn.reader._buffer:  # the sender must wait for data_ok before sending steps
            raise ProtocolError("data sent before data_ok")
        sock = detach(conn.writer)  # no read can slip in now
        try:
            sock.settimeout(self.cfg.forward_timeout_s)
            sock.sendall(pack(m.DataReady(id=msg.id)))
        except OSError as exc:
            sock.close()
            log.debug("%s: gone before data_ok: %r", conn.peer, exc)
            return True
        if msg.role == "in":
            self.data.add_inbound(sock, msg.plan_id, fingerprint)
        else:
            self.data.set_sink(msg.plan_id, sock)
        return True

    # ---- what only the node knows ---------------------------------------------------------
    async def _stats(self, msg: m.StatsRequest, owner: str) -> m.StatsReply:
        d = self.data
        return m.StatsReply(id=msg.id, stats={
            "node": self.name, "bad_frames": self.bad_frames + d.bad_frames,
            "kernel": kernels.status(self.cfg.runtime),
            "batches": d.batches, "batched_steps": d.batched_steps, "lane_steps": d.lane_steps,
            "steps_waiting_for_restores": d.steps_waiting,
            "data_plane": {"alive": d.thread.is_alive(), "failures": d.failures,
                           "restarts": self.restarts},
            "connections": len(self.conns), "refused_connections": self.admission.refused["connections"],
            "refused_strangers": self.admission.refused["strangers"],
            "frame_budget": {"held": self.frame_budget.held, "waited": self.frame_budget.waited},
            "memory": {"rss_bytes": resident_bytes(), "peak_rss_bytes": peak_resident_bytes(),
                       "budget_bytes": self.cfg.memory_budget_bytes},
            **self.sessions.stats(), **self.store.stats(owner, self._client(owner)[0])})

    def _client(self, owner: str) -> tuple[str, str]:
        """Whose KV a client's is, and where it connected from (a request can only come from a
        connected client; its connection's own key otherwise)."""
        who = self.clients.get(owner) or Client(kv_domain(owner), "")
        return who.kv_domain, who.address

    # ---- housekeeping -------------------------------------------------------------------
    async def _housekeeping(self) -> None:
        swept = 0.0
        while True:
            await asyncio.sleep(self.cfg.supervise_s)
            await self._supervise()
            await self._release_orphans()
            try:
                if n := await self.data.submit(lambda: self.store.expire(self.cfg.session_ttl_s)):
                    log.info("expired %d idle sessions", n)
            except EdgeliteError as exc:  # (the thread ended just now: the next round restarts it)
                log.warning("housekeeping: %s", exc)
            if time.monotonic() - swept >= min(PART_SWEEP_S, self.cfg.part_ttl_s):
                swept = time.monotonic()
                await asyncio.to_thread(self.store.blobs.clean_parts)
                if self.cfg.blob_idle_ttl_s > 0:
                    await asyncio.to_thread(self.store.blobs.collect, self.cfg.blob_idle_ttl_s)

    async def _supervise(self) -> None:
        """Restart the data plane's thread if it ended without being stopped (its connections
        are gone with it; stages reconnect onward, clients open theirs again)."""
        old = self.data
        if old.thread.is_alive() or old.stopping:
            return
        self.restarts += 1
        log.error("the data plane thread ended unexpectedly; restarting it (restart %d)", self.restarts)
        self.data = DataPlane(self.name, self.store, self.cfg, self.limits)
        self.data.bad_frames, self.data.failures = old.bad_frames, old.failures
        self.data.batches, self.data.batched_steps = old.batches, old.batched_steps
        self.data.lane_steps = old.lane_steps
        self.data.start()
        for stage in list(self.store.stages.values()):
            if stage.next_addr is not None:
                try:
                    await self.deploy.connect_onward(stage)
                except (EdgeliteError, OSError) as exc:
                    log.warning("plan %s: no connection onward after the restart: %s",
                                stage.plan_id[:12], exc)

    async def _release_orphans(self) -> None:
        """Unload the plans of clients with no control connection for owner_grace_s."""
        now = time.monotonic()
        owners = {s.owner for s in self.store.stages.values()} - set(self.owners)
        self.orphaned = {o: self.orphaned.get(o, now) for o in owners}
        for owner, since in list(self.orphaned.items()):
            if now - since < self.cfg.owner_grace_s:
                continue
            for plan_id in self.store.plans_of(owner):
                freed = await self.data.unload(plan_id)
                log.info("unloaded plan %s of a client that left (%d sessions freed)",
                         plan_id[:12], freed)
            del self.orphaned[owner]


@contextlib.asynccontextmanager
async def run_node(token: str, data_dir: str | Path, cfg: NodeConfig | None = None,
                   name: str | None = None) -> AsyncIterator[Node]:
    """A node serving inside this process until the block ends:

        async with edgelite.run_node("secret", "/tmp/node0", NodeConfig(port=0)) as node:
            print(node.addr)
    """
    node = Node(cfg or NodeConfig(), token, Path(data_dir), **({"name": name} if name else {}))
    await node.start()
    serving = asyncio.get_running_loop().create_task(node.run(), name=f"node {node.addr}")
    try:
        yield node
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
