"""The stage node: an asyncio TCP server holding layer ranges, per-session KV, deployed files.

Control requests (deploy, load, ping, stats, probes) are served on the event loop, one typed
message each (net/messages.py). A connection that asks for `data` is handed to the data plane
(dataplane.py): one thread that reads steps, runs the stage's layers and writes each result
straight on to the next stage (or, from the last stage, to the plan's client). A bad frame costs
its sender an error reply, never the node or another session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import platform
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgelite.config import NodeConfig, WireLimits
from edgelite.engine.profile import host_profile
from edgelite.errors import AuthError, EdgeliteError, ProtocolError
from edgelite.ids import NodeAddr
from edgelite.net import messages as m
from edgelite.net.frames import Conn, bound_port, detach, pack
from edgelite.net.handshake import connect, server_handshake
from edgelite.net.linkprobe import ProbeConfig, UdpEcho, probe_peer
from edgelite.net.schema import Message
from edgelite.node.blobs import BlobStore, check_sha
from edgelite.node.dataplane import DataPlane
from edgelite.node.profile import measure_flops
from edgelite.node.stages import StageStore

log = logging.getLogger(__name__)
Handler = Callable[[Any], Awaitable[Message]]


@dataclass
class Node:
    cfg: NodeConfig
    token: str
    data_dir: Path
    name: str = field(default_factory=platform.node)
    limits: WireLimits = field(default_factory=WireLimits)

    def __post_init__(self) -> None:
        self.store = StageStore(BlobStore(self.data_dir), self.cfg.kv_budget_bytes, self.cfg.runtime)
        self.data = DataPlane(self.name, self.store, self.cfg, self.limits)
        self.server: asyncio.Server | None = None
        self.conns: set[Conn] = set()  # open client connections, closed on shutdown
        self.handlers: set[asyncio.Task[None]] = set()  # their handler tasks (owned by the server)
        self.bad_frames = 0
        self.udp: asyncio.DatagramTransport | None = None
        self.udp_port = 0
        # FLOP/s measurements run here, off the loop (forward steps run in the data plane)
        self.compute_pool = ThreadPoolExecutor(1, thread_name_prefix="profile")
        self._handlers: dict[type[Message], Handler] = {
            m.Ping: self._ping, m.StatsRequest: self._stats, m.FilesQuery: self._files,
            m.Upload: self._upload, m.Load: self._load, m.EndSession: self._end,
            m.Bulk: self._bulk, m.ProfileRequest: self._profile, m.ProbeLink: self._probe_link}

    @property
    def port(self) -> int:
        return bound_port(self.server)

    @property
    def addr(self) -> NodeAddr:
        return NodeAddr(self.cfg.host, self.port)

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, self.cfg.host, self.cfg.port)
        loop = asyncio.get_running_loop()
        try:  # the UDP echo for loss probes shares the TCP port number when it is free
            self.udp, _ = await loop.create_datagram_endpoint(
                lambda: UdpEcho(self.token), local_addr=(self.cfg.host, self.port))
        except OSError:
            self.udp, _ = await loop.create_datagram_endpoint(
                lambda: UdpEcho(self.token), local_addr=(self.cfg.host, 0))
        self.udp_port = self.udp.get_extra_info("sockname")[1]
        self.data.start()

    async def run(self) -> None:
        """Serve until cancelled: the server and the session reaper (the data plane runs in its
        thread). On the way out every connection is closed and its handler has finished."""
        if self.server is None:
            await self.start()
        assert self.server is not None
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._reaper())
                tg.create_task(self.server.serve_forever())
        finally:
            await self.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.udp is not None:
            self.udp.close()
        for conn in self.conns:
            conn.writer.close()
        handlers = [t for t in self.handlers if t is not asyncio.current_task()]
        if handlers:
            await asyncio.wait(handlers, timeout=self.cfg.shutdown_timeout_s)
        self.compute_pool.shutdown(wait=False)
        await self.data.stop()

    # ---- connections -------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = writer.get_extra_info("peername")[:2]
        conn = Conn(reader, writer, self.limits, f"{host}:{port}")
        me = asyncio.current_task()
        self.conns.add(conn)
        if me is not None:
            self.handlers.add(me)
        try:
            fps = sorted({s.manifest.fingerprint for s in self.store.stages.values()})
            auth = await asyncio.wait_for(
                server_handshake(conn, self.token, self.name, fps, self.port, self.udp_port),
                self.cfg.handshake_timeout_s)
            await self._serve(conn, auth.fingerprint)
        except (AuthError, ProtocolError) as exc:
            self.bad_frames += 1
            log.warning("%s: %s; closing", conn.peer, exc)
            await self._try_send(conn, m.Error(message=str(exc)))
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            log.debug("%s: connection ended: %r", conn.peer, exc)
        finally:
            self.conns.discard(conn)
            self.handlers.discard(me)  # type: ignore[arg-type]
            await conn.close()

    async def _serve(self, conn: Conn, fingerprint: str | None) -> None:
        while True:
            try:
                frame = await asyncio.wait_for(conn.recv_frame(), self.cfg.idle_timeout_s)
            except asyncio.IncompleteReadError:
                return  # clean close between frames
            rid = frame.get("id") if type(frame.get("id")) is int else None
            try:
                msg = m.parse(frame, self.limits)
                if isinstance(msg, m.OpenData):
                    if await self._data(conn, msg, fingerprint):
                        return  # the connection now belongs to the data plane
                    continue
                handler = self._handlers.get(type(msg))
                if handler is None:
                    raise ProtocolError(f"{msg.TYPE} is not a request this node serves")
                await conn.send(await handler(msg))
            except EdgeliteError as exc:  # the request was bad; the connection stays usable
                self.bad_frames += 1
                log.info("%s: %s refused: %s", conn.peer, frame.get("type"), exc)
                await conn.send(m.Error(message=str(exc), id=rid))

    async def _try_send(self, conn: Conn, msg: Message) -> None:
        try:
            await conn.send(msg)
        except (ConnectionError, OSError):
            log.debug("%s: could not send %s", conn.peer, msg.TYPE)

    async def _data(self, conn: Conn, msg: m.OpenData, fingerprint: str | None) -> bool:
        """Hand this connection to the data plane: `in` carries steps into this node, `sink`
        takes a plan's results back to its client. False: the connection stays here."""
        self.store.stage_for(msg.plan_id, fingerprint)
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
            self.data.add_inbound(sock, fingerprint)
        else:
            self.data.set_sink(msg.plan_id, sock)
        return True

    # ---- control requests --------------------------------------------------------------
    async def _ping(self, msg: m.Ping) -> m.Pong:
        # the receive time on this node's clock: senders get one-way delay variation from it
        return m.Pong(id=msg.id, t=msg.t, rt=time.monotonic())

    async def _bulk(self, msg: m.Bulk) -> m.BulkAck:
        if msg.reply_bytes > self.cfg.bulk_reply_max_bytes:
            raise ProtocolError(f"bulk reply_bytes must be at most {self.cfg.bulk_reply_max_bytes}")
        return m.BulkAck(id=msg.id, received=len(msg.data), data=bytes(msg.reply_bytes))

    async def _profile(self, msg: m.ProfileRequest) -> m.ProfileReply:
        flops = await asyncio.get_running_loop().run_in_executor(
            self.compute_pool, measure_flops, self.store, msg.hidden_size, msg.manifest)
        budget = {} if self.cfg.memory_budget_bytes is None else {
            "memory_budget_bytes": self.cfg.memory_budget_bytes}
        return m.ProfileReply(id=msg.id, profile={"node": self.name, "threads": self.cfg.runtime.threads,
                                                  "provider": self.cfg.runtime.provider,
                                                  **flops, **host_profile(), **budget})

    async def _probe_link(self, msg: m.ProbeLink) -> m.LinkReport:
        try:
            cfg = ProbeConfig(**msg.config)
        except TypeError as exc:
            raise ProtocolError(f"probe_link config: {exc}") from exc
        stats = await probe_peer(msg.peer, self.token, cfg)
        return m.LinkReport(id=msg.id, link=stats.to_json())

    async def _stats(self, msg: m.StatsRequest) -> m.StatsReply:
        return m.StatsReply(id=msg.id, stats={
            "node": self.name, "bad_frames": self.bad_frames + self.data.bad_frames,
            "batches": self.data.batches, "batched_steps": self.data.batched_steps,
            **self.store.stats()})

    async def _files(self, msg: m.FilesQuery) -> m.FilesState:
        shas = [check_sha(s) for s in msg.sha256]
        b = self.store.blobs
        return m.FilesState(id=msg.id, have=[s for s in shas if b.has(s)],
                            partial={s: b.partial(s) for s in shas})

    async def _upload(self, msg: m.Upload) -> m.UploadAck:
        held = await asyncio.to_thread(self.store.blobs.append, check_sha(msg.sha256), msg.offset,
                                       msg.total, msg.data)
        return m.UploadAck(id=msg.id, held=held, complete=held == msg.total)

    async def _load(self, msg: m.Load) -> m.Loaded:
        stage = await asyncio.to_thread(self.store.build, msg.plan_id, msg.manifest, msg.first,
                                        msg.last, msg.next)
        if msg.next is not None:
            await self._connect_onward(msg.next, msg.plan_id, stage.manifest.fingerprint)
        self.store.stages[msg.plan_id] = stage
        log.info("loaded plan %s: layers %d-%d, next %s", msg.plan_id, msg.first, msg.last, msg.next)
        return m.Loaded(id=msg.id, first=msg.first, last=msg.last)

    async def _end(self, msg: m.EndSession) -> m.Ended:
        session = msg.session
        return m.Ended(id=msg.id, freed=await self.data.submit(lambda: self.store.end(session)))

    async def _connect_onward(self, addr: NodeAddr, plan_id: str, fingerprint: str) -> None:
        """A data connection to the next stage (which has loaded the plan already)."""
        try:
            conn, _ = await connect(addr, self.token, fingerprint, self.limits,
                                    self.cfg.forward_connect_timeout_s)
        except (ConnectionError, AuthError) as exc:
            raise EdgeliteError(f"next stage {exc}") from exc
        try:
            await conn.send(m.OpenData(id=0, plan_id=plan_id, role="in"))
            reply = await asyncio.wait_for(conn.recv(), self.cfg.forward_connect_timeout_s)
            if not isinstance(reply, m.DataReady):
                raise EdgeliteError(f"next stage {addr}: "
                                    f"{getattr(reply, 'message', reply.TYPE)}")
        except BaseException:
            await conn.close()
            raise
        self.data.set_outbound(addr, detach(conn.writer))

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(min(60.0, self.cfg.session_ttl_s))
            if n := self.store.expire(self.cfg.session_ttl_s):
                log.info("expired %d idle sessions", n)



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
