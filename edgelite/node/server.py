"""The stage node: an asyncio TCP server holding layer ranges, per-session KV, deployed files.

Control requests (deploy, load, ping, stats, probes) are served on the event loop, one typed
message each (net/messages.py). A connection that asks for `data` is handed to the data plane
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
import dataclasses
import hmac
import logging
import platform
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgelite.config import NodeConfig, WireLimits
from edgelite.engine.kv import Slot
from edgelite.engine.kvstore import KVStore, hand_over, open_store, restore_into
from edgelite.engine.profile import host_profile
from edgelite.errors import AuthError, EdgeliteError, ProtocolError, StreamError
from edgelite.ids import NodeAddr
from edgelite.net import messages as m
from edgelite.net.budget import ByteBudget
from edgelite.net.discovery import respond
from edgelite.net.frames import Conn, bound_port, detach, listen, pack, unpack
from edgelite.net.handshake import connect, server_handshake
from edgelite.net.linkprobe import ProbeConfig, UdpEcho, probe_peer
from edgelite.net.schema import Message
from edgelite.node import kvshare
from edgelite.node.blobs import BlobStore, check_sha
from edgelite.node.dataplane import DataPlane
from edgelite.node.kvshare import kv_tokens
from edgelite.node.profile import loaded_flops, measure_flops
from edgelite.node.shelf import Shelf
from edgelite.node.stages import Stage, StageStore, kv_domain

log = logging.getLogger(__name__)
Handler = Callable[[Any, str], Awaitable[Message]]  # (request, its client's owner key) -> reply
PART_SWEEP_S = 60.0  # how often abandoned partial uploads are looked for (at most)


def probe_config(raw: dict[str, Any], cfg: NodeConfig) -> ProbeConfig:
    """A link probe's settings from a request, each field type-checked and within this node's
    limits (a probe makes the node send packets and bytes: a request may not ask for many)."""
    caps: dict[str, tuple[float, float]] = {
        "pings": (1, 1000), "bulk_start_bytes": (1, cfg.max_probe_bytes),
        "bulk_max_bytes": (1, cfg.max_probe_bytes), "bulk_min_seconds": (0, cfg.max_probe_timeout_s),
        "udp_packets": (0, cfg.max_probe_packets), "udp_interval_s": (0, 1),
        "udp_wait_s": (0, cfg.max_probe_timeout_s), "timeout_s": (0.01, cfg.max_probe_timeout_s)}
    known = {f.name: f for f in dataclasses.fields(ProbeConfig)}
    values: dict[str, Any] = {}
    for key, v in raw.items():
        f = known.get(key) if type(key) is str else None
        if f is None:
            raise ProtocolError(f"probe_link.config: unknown field {str(key)[:40]!r}")
        kind = type(f.default)
        if kind is bool:
            if type(v) is not bool:
                raise ProtocolError(f"probe_link.config.{key}: expected true or false")
        elif type(v) not in ((int,) if kind is int else (int, float)):
            raise ProtocolError(f"probe_link.config.{key}: expected a number, got {type(v).__name__}")
        elif not caps[key][0] <= v <= caps[key][1]:
            raise ProtocolError(f"probe_link.config.{key}: {v} is outside "
                                f"{caps[key][0]:g}..{caps[key][1]:g} (this node's limit)")
        values[key] = v
    return ProbeConfig(**values)


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
        blobs = BlobStore(self.data_dir, c.max_file_bytes, c.disk_quota_bytes, c.part_ttl_s)
        self.store = StageStore(blobs, c.kv_budget_bytes, c.runtime, c.max_sessions_per_client,
                                c.memory_budget_bytes, c.max_address_kv_share)
        self.shelf = Shelf(self.data_dir, blobs)  # model folders pushed here (edgelite push)
        self.data = DataPlane(self.name, self.store, c, self.limits)
        self.kv: KVStore | None = None  # the KV store, opened by start()
        self.server: asyncio.Server | None = None
        self.conns: set[Conn] = set()  # open client connections, closed on shutdown
        self.handlers: set[asyncio.Task[None]] = set()  # their handler tasks (owned by the server)
        self.bad_frames = 0
        self.refused_connections = 0
        self.restarts = 0  # data plane threads restarted after dying
        self.udp: asyncio.DatagramTransport | None = None
        self.discovery: asyncio.DatagramTransport | None = None  # answers `--nodes auto`
        self.udp_port = 0
        self.owners: dict[str, int] = {}  # client key -> its open control connections
        self.frame_budget = ByteBudget(c.max_held_frame_bytes)  # requests' frames, all connections
        self.strangers: dict[str, int] = {}  # address -> its connections not yet authenticated
        self.refused_strangers = 0  # connections refused before the handshake (their budget)
        self.clients: dict[str, Client] = {}  # client key -> whose KV, from where
        self.orphaned: dict[str, float] = {}  # owners of plans with no connection, since when
        self.loading: dict[str, str] = {}  # plan ids being loaded -> their owners
        # restores under way, each reading a KV store entry into its session's slot
        self.restores: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.exports = kvshare.Exports(c)  # stored KV read for other nodes (kv_export)
        self.bulk_slots = asyncio.Semaphore(c.bulk_concurrency)
        self.probe_slots = asyncio.Semaphore(c.probe_concurrency)
        self.profiling = False
        # FLOP/s measurements run here, off the loop (forward steps run in the data plane)
        self.compute_pool = ThreadPoolExecutor(1, thread_name_prefix="profile")
        self._handlers: dict[type[Message], Handler] = {
            m.Ping: self._ping, m.StatsRequest: self._stats, m.FilesQuery: self._files,
            m.Upload: self._upload, m.ModelPut: self._model_put, m.Load: self._load, m.EndSession: self._end,
            m.Bulk: self._bulk, m.ProfileRequest: self._profile, m.ProbeLink: self._probe_link,
            m.KvSave: self._kv_save, m.KvRestore: self._kv_restore, m.KvExport: self._kv_export,
            m.KvExportRead: self._kv_export_read}

    @property
    def port(self) -> int:
        return bound_port(self.server)

    @property
    def addr(self) -> NodeAddr:
        return NodeAddr(self.cfg.host, self.port)

    async def start(self) -> None:
        self.kv = await asyncio.to_thread(open_store, self.cfg.runtime.kv_store, self.data_dir / "kv")
        self.server = await listen(self._handle, self.cfg.host, self.cfg.port)
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
        self.compute_pool.shutdown(wait=False)
        restores = list(self.restores.values())
        for t in restores:
            t.cancel()
        await asyncio.gather(*restores, return_exceptions=True)  # each frees its slot first
        await self.data.stop()
        if self.kv is not None:
            await asyncio.to_thread(self.kv.close)  # (after its queued writes)

    # ---- connections -------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = writer.get_extra_info("peername")[:2]
        conn = Conn(reader, writer, self.limits, f"{host}:{port}")
        c, strangers, theirs = self.cfg, sum(self.strangers.values()), self.strangers.get(host, 0)
        if strangers >= c.max_unauthenticated or theirs >= c.max_unauthenticated_per_address:
            # (strangers have a budget of their own: a flood of them does not keep clients out)
            self.refused_strangers += 1
            log.debug("%s: refused before the handshake: %d connections not authenticated, %d of "
                      "them from there", conn.peer, strangers, theirs)
            await conn.close()
            return
        if len(self.conns) >= c.max_connections:
            self.refused_connections += 1
            log.warning("%s: refused: %d connections open (max_connections)", conn.peer, len(self.conns))
            await self._try_send(conn, m.Error(message=f"this node has {len(self.conns)} connections "
                                                       f"open, its limit; try later"))
            await conn.close()
            return
        me = asyncio.current_task()
        if me is not None:
            self.handlers.add(me)
        owner, stranger = None, True
        self.strangers[host] = self.strangers.get(host, 0) + 1
        try:
            fps = sorted({s.manifest.fingerprint for s in self.store.stages.values()})
            auth = await asyncio.wait_for(
                server_handshake(conn, self.token, self.name, fps, self.port, self.udp_port),
                c.handshake_timeout_s)
            self._stranger_gone(host)
            stranger = False
            self.conns.add(conn)
            owner = auth.client or f"connection-{secrets.token_hex(16)}"
            self.clients[owner] = Client(kv_domain(auth.kv or owner), host)
            self.owners[owner] = self.owners.get(owner, 0) + 1
            self.orphaned.pop(owner, None)
            await self._serve(conn, auth.fingerprint, owner)
        except (AuthError, ProtocolError) as exc:
            self.bad_frames += 1
            log.warning("%s: %s; closing", conn.peer, exc)
            await self._try_send(conn, m.Error(message=str(exc)))
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            log.debug("%s: connection ended: %r", conn.peer, exc)
        finally:
            if stranger:
                self._stranger_gone(host)
            if owner is not None:
                self.owners[owner] -= 1
                if not self.owners[owner]:
                    del self.owners[owner]
                    self.clients.pop(owner, None)
                    self.exports.drop(owner)
            self.conns.discard(conn)
            self.handlers.discard(me)  # type: ignore[arg-type]
            await conn.close()

    def _stranger_gone(self, host: str) -> None:
        self.strangers[host] -= 1
        if not self.strangers[host]:
            del self.strangers[host]

    async def _serve(self, conn: Conn, fingerprint: str | None, owner: str) -> None:
        """Answer requests until the peer closes. Each request runs on its own and is answered
        when done (replies carry the request's id), at most `max_requests_per_connection` at
        once (more wait their turn), so a slow one (a KV write waiting behind a long prefill, a
        model load, a link probe) holds back neither the pings of the client's heartbeat, which
        are answered as they are read, nor its other requests. Past `max_queued_requests` the
        connection is not read until one is done, nor while their frames hold
        `max_queued_request_bytes`. A bad request gets an error reply and the connection stays;
        a broken stream (StreamError) ends it. Requests under way when the peer leaves still
        finish."""
        cfg = self.cfg
        slots = asyncio.Semaphore(cfg.max_requests_per_connection)
        running: dict[asyncio.Task[None], int] = {}  # -> the bytes of its frame
        conn.budget = self.frame_budget  # every connection's frames, read and held, within it
        try:
            while True:
                if running and (len(running) >= cfg.max_queued_requests
                                or sum(running.values()) >= cfg.max_queued_request_bytes):
                    await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                    continue
                # (nothing of the last frame stays referenced here while the next one waits)
                frame: dict[str, Any] = {}
                body, msg = b"", None
                try:
                    try:
                        body = await asyncio.wait_for(conn.recv_body(), cfg.idle_timeout_s)
                    except asyncio.IncompleteReadError:
                        return  # clean close between frames
                    frame = unpack(body)
                    msg = m.parse(frame, self.limits)
                    if isinstance(msg, m.OpenData):
                        if running:
                            raise ProtocolError("data: requests are under way on this connection")
                        if await self._data(conn, msg, fingerprint):
                            return  # the connection now belongs to the data plane
                        continue
                    if isinstance(msg, m.Ping):
                        await conn.send(await self._ping(msg, owner))
                        continue
                    handler = self._handlers.get(type(msg))
                    if handler is None:
                        raise ProtocolError(f"{msg.TYPE} is not a request this node serves")
                    task = asyncio.create_task(self._answer(conn, frame, msg, handler, owner, slots),
                                               name=f"{conn.peer} {msg.TYPE}")
                    running[task] = len(body)  # (its bytes are given back when it is done)
                    task.add_done_callback(self._request_done(running))
                    body = b""
                except StreamError:
                    raise
                except EdgeliteError as exc:  # the request was bad; the connection stays usable
                    await self._refused(conn, frame, exc)
                finally:
                    if body:  # a frame answered here (or refused): its bytes are free
                        self.frame_budget.give(len(body))
        finally:
            if running:
                try:
                    await asyncio.wait(running)
                except asyncio.CancelledError:  # the node is stopping
                    for task in running:
                        task.cancel()
                    await asyncio.gather(*running, return_exceptions=True)
                    raise

    def _request_done(self, running: dict[asyncio.Task[None], int]) -> Callable[[asyncio.Task[None]], None]:
        def done(task: asyncio.Task[None]) -> None:
            self.frame_budget.give(running.pop(task))  # its frame is no longer held
        return done

    async def _answer(self, conn: Conn, frame: dict[str, Any], msg: Message, handler: Handler,
                      owner: str, slots: asyncio.Semaphore) -> None:
        """One request's reply, or its error (the connection stays), once it has a slot."""
        try:
            async with slots:
                await self._try_send(conn, await handler(msg, owner))
        except EdgeliteError as exc:
            await self._refused(conn, frame, exc)
        except (TimeoutError, OSError) as exc:
            await self._refused(conn, frame, EdgeliteError(f"{msg.TYPE} failed: {exc or type(exc).__name__}"))
        except Exception as exc:  # a fault of this node's own: the node and the connection go on
            log.exception("%s: %s failed", conn.peer, msg.TYPE)
            await self._refused(conn, frame, EdgeliteError(f"{msg.TYPE} failed on the node: {exc!r}"[:300]))

    async def _refused(self, conn: Conn, frame: dict[str, Any], exc: EdgeliteError) -> None:
        self.bad_frames += 1
        rid = m.reply_id(frame)
        log.info("%s: %s refused: %s", conn.peer, str(frame.get("type"))[:40], exc)
        await self._try_send(conn, m.Error(message=str(exc), id=rid))

    async def _try_send(self, conn: Conn, msg: Message) -> None:
        try:
            await conn.send(msg)
        except (ConnectionError, OSError):
            log.debug("%s: could not send %s", conn.peer, msg.TYPE)

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

    # ---- control requests --------------------------------------------------------------
    async def _ping(self, msg: m.Ping, _owner: str) -> m.Pong:
        # the receive time on this node's clock: senders get one-way delay variation from it
        return m.Pong(id=msg.id, t=msg.t, rt=time.monotonic())

    async def _bulk(self, msg: m.Bulk, _owner: str) -> m.BulkAck:
        if msg.reply_bytes > self.cfg.bulk_reply_max_bytes:
            raise ProtocolError(f"bulk.reply_bytes: {msg.reply_bytes} is over this node's limit "
                                f"of {self.cfg.bulk_reply_max_bytes}")
        if self.bulk_slots.locked():
            raise ProtocolError(f"bulk: {self.cfg.bulk_concurrency} transfers are under way "
                                f"(bulk_concurrency); try later")
        async with self.bulk_slots:
            return m.BulkAck(id=msg.id, received=len(msg.data), data=bytes(msg.reply_bytes))

    async def _profile(self, msg: m.ProfileRequest, _owner: str) -> m.ProfileReply:
        if self.profiling:
            raise ProtocolError("profile: a profile is being measured already; try later")
        self.profiling = True
        try:
            flops = await self.data.submit(lambda: loaded_flops(self.store))
            if flops is None:
                c = self.cfg
                flops = await asyncio.get_running_loop().run_in_executor(
                    self.compute_pool, measure_flops, self.store, msg.hidden_size, msg.manifest,
                    c.max_profile_hidden, c.max_profile_bytes)
        finally:
            self.profiling = False
        budget = {} if self.cfg.memory_budget_bytes is None else {
            "memory_budget_bytes": self.cfg.memory_budget_bytes}
        return m.ProfileReply(id=msg.id, profile={"node": self.name, "threads": self.cfg.runtime.threads,
                                                  "provider": self.cfg.runtime.provider,
                                                  **flops, **host_profile(), **budget})

    async def _probe_link(self, msg: m.ProbeLink, _owner: str) -> m.LinkReport:
        """Measure the link to another node. Packets go only to a peer that has completed the
        handshake with this cluster's token (probe_peer connects first), within the limits."""
        cfg = probe_config(msg.config, self.cfg)
        async with self.probe_slots:  # at most probe_concurrency at once; the others wait
            stats = await probe_peer(msg.peer, self.token, cfg)
        return m.LinkReport(id=msg.id, link=stats.to_json())

    async def _stats(self, msg: m.StatsRequest, owner: str) -> m.StatsReply:
        d = self.data
        return m.StatsReply(id=msg.id, stats={
            "node": self.name, "bad_frames": self.bad_frames + d.bad_frames,
            "batches": d.batches, "batched_steps": d.batched_steps, "lane_steps": d.lane_steps,
            "restores": len(self.restores), "steps_waiting_for_restores": d.steps_waiting,
            "data_plane": {"alive": d.thread.is_alive(), "failures": d.failures,
                           "restarts": self.restarts},
            "connections": len(self.conns), "refused_connections": self.refused_connections,
            "refused_strangers": self.refused_strangers,
            "frame_budget": {"held": self.frame_budget.held, "waited": self.frame_budget.waited},
            "kv_store": self.kv.stats() if self.kv is not None else None,
            "kv_exports": self.exports.stats(),
            **self.store.stats(owner)})

    async def _files(self, msg: m.FilesQuery, _owner: str) -> m.FilesState:
        shas = [check_sha(s) for s in msg.sha256]
        b = self.store.blobs
        # (a blob counts only when intact: a damaged one is deleted and uploaded again)
        have = await asyncio.to_thread(lambda: [s for s in shas if b.intact(s)])
        return m.FilesState(id=msg.id, have=have, partial={s: b.partial(s) for s in shas})

    async def _upload(self, msg: m.Upload, _owner: str) -> m.UploadAck:
        held = await asyncio.to_thread(self.store.blobs.append, check_sha(msg.sha256), msg.offset,
                                       msg.total, msg.data)
        return m.UploadAck(id=msg.id, held=held, complete=held == msg.total)

    def _client(self, owner: str) -> Client:
        """Whose KV a client's is, and where it connected from (a request can only come from a
        connected client; its connection's own key otherwise)."""
        return self.clients.get(owner) or Client(kv_domain(owner), "")

    async def _model_put(self, msg: m.ModelPut, owner: str) -> m.ModelStored:
        path = await asyncio.to_thread(self.shelf.put, msg.name, msg.files,
                                       self._client(owner).kv_domain)
        return m.ModelStored(id=msg.id, path=str(path), files=len(msg.files))

    async def _load(self, msg: m.Load, owner: str) -> m.Loaded:
        pid = msg.plan_id
        existing = self.store.stages.get(pid)
        if pid in self.loading or (existing is not None and existing.owner != owner):
            raise ProtocolError(f"load: plan_id {pid[:12]} is another client's")
        held = len(self.store.plans_of(owner)) + sum(o == owner for o in self.loading.values())
        if existing is None and held >= self.cfg.max_plans_per_client:  # (loading ones count)
            raise ProtocolError(f"load: this client has {self.cfg.max_plans_per_client} plans "
                                f"loaded here, the limit (max_plans_per_client)")
        if (msg.next is None) != (msg.next_capability is None):
            raise ProtocolError("load: next and next_capability go together")
        self.loading[pid] = owner
        who = self._client(owner)
        try:
            stage = await asyncio.to_thread(self.store.build, pid, msg.manifest, msg.first,
                                            msg.last, msg.next, owner, msg.next_capability,
                                            who.kv_domain, who.address)
            try:
                await self.data.install(stage)
            except BaseException:
                self.store.release(stage)
                raise
            if msg.next is not None:
                try:
                    await self._connect_onward(stage)
                except BaseException:
                    await self.data.unload(pid)
                    raise
        finally:
            self.loading.pop(pid, None)
        log.info("loaded plan %s: layers %d-%d, next %s", pid, msg.first, msg.last, msg.next)
        return m.Loaded(id=msg.id, first=msg.first, last=msg.last, capability=stage.capability)

    async def _end(self, msg: m.EndSession, owner: str) -> m.Ended:
        self._own_stage(msg.plan_id, owner, "end")
        plan_id, session = msg.plan_id, msg.session
        await self._restore_done(plan_id, session)
        return m.Ended(id=msg.id, freed=await self.data.submit(
            lambda: self.data.end(plan_id, session)))

    def _own_stage(self, plan_id: str, owner: str, what: str) -> Stage:
        stage = self.store.stages.get(plan_id)
        if stage is None or stage.owner != owner:
            raise ProtocolError(f"{what}: plan {plan_id[:12]} is not loaded here by this client")
        return stage

    async def _kv_save(self, msg: m.KvSave, owner: str) -> m.KvSaved:
        """Store a session's KV (copied on the data plane's thread, after the steps before
        this request; written off it, and with `behind` after the answer: a later restore or
        export waits for the write)."""
        stage = self._own_stage(msg.plan_id, owner, "kv_save")
        tokens = kv_tokens(msg.tokens, "kv_save")
        if self.kv is None or len(tokens) < self.kv.block:
            return m.KvSaved(id=msg.id, bytes=0)
        plan_id, session = msg.plan_id, msg.session
        await self._restore_done(plan_id, session)
        kv = await self.data.submit(lambda: self.store.export_kv(plan_id, session, len(tokens)))
        try:
            put = self.kv.put_later if msg.behind else self.kv.put
            size = await asyncio.to_thread(put, stage.kv_layout, tokens, kv)
        except OSError as exc:
            raise EdgeliteError(f"kv_save: the KV store cannot write: {exc}") from exc
        return m.KvSaved(id=msg.id, bytes=size)

    async def _kv_restore(self, msg: m.KvRestore, owner: str) -> m.KvRestored:
        """Start a session from the KV store, in two parts. The answer comes once the index
        has given the longest stored prefix and a slot is reserved for it (on the data plane's
        thread); the entry is then read and checked into the slot off that thread while the
        client goes on (its own layers, its first step). Steps of the session wait for the
        read on the data plane (no other session's step does); the slot then becomes the
        session's, or, when the entry failed its checks, is freed and those steps fail (the
        client computes the prompt instead)."""
        stage = self._own_stage(msg.plan_id, owner, "kv_restore")
        tokens = kv_tokens(msg.tokens, "kv_restore")[:stage.layers.pool.max_length]
        plan_id, session, kv, layout = msg.plan_id, msg.session, self.kv, stage.kv_layout
        await self._restore_done(plan_id, session)
        own = 0
        if kv is not None and len(tokens) >= kv.block:
            own = await asyncio.to_thread(kv.longest, layout, tokens)
        imp = None
        if msg.sources and own < len(tokens):  # its layers were held by other stages
            imp = await kvshare.plan(kv, layout, tokens, msg.sources, self.token, self.limits, self.cfg)
        try:
            use = imp if imp is not None and imp.length > own else None  # else its own entries
            length = use.length if use is not None else own
            if msg.exact and length != len(msg.tokens) // 4:
                length = 0
            if not length:
                await self.data.submit(lambda: self.data.end(plan_id, session))
                return m.KvRestored(id=msg.id, length=0)
            slot = await self.data.submit(lambda: self.data.reserve(stage, session, length))
            key = (plan_id, session)
            task = asyncio.create_task(self._fill(stage, session, slot, tokens[:length], use))
            imp = None if use is imp else imp  # the fill closes the import it was handed
            self.restores[key] = task
            task.add_done_callback(lambda t: self._forget_restore(key, t))
            return m.KvRestored(id=msg.id, length=length)
        finally:
            if imp is not None:
                await imp.close()

    async def _fill(self, stage: Stage, session: str, slot: Slot, tokens: np.ndarray,
                    imp: kvshare.Import | None) -> None:
        """Read the entry for exactly `tokens` (or, with `imp`, the layers' KV from where
        the plan before held them) into the reserved slot, then hand it over."""
        view = stage.layers.pool.view(slot)

        def attach(n: int) -> Awaitable[int]:
            return self.data.submit(lambda: self.data.restored(stage, session, slot, n))

        def abandon() -> Awaitable[None]:
            return self.data.submit(lambda: self.data.restored(stage, session, slot, None))

        try:
            if imp is None:
                assert self.kv is not None
                await restore_into(self.kv, stage.kv_layout, tokens, view, True, attach, abandon)
            else:
                await hand_over(kvshare.fill(self.kv, imp, tokens, view, self.cfg.kv_fetch_timeout_s),
                                attach, abandon)
        except (EdgeliteError, OSError, TimeoutError) as exc:  # unloaded meanwhile, stopping
            log.warning("session %s: its KV was not restored: %s", session[:12], exc)

    async def _kv_export(self, msg: m.KvExport, owner: str) -> m.KvExportReady:
        """Another node takes over layers of a conversation this node stored (KvRestore.sources)."""
        return await self.exports.open(self.kv, msg, owner)

    async def _kv_export_read(self, msg: m.KvExportRead, owner: str) -> m.KvExportData:
        return self.exports.read(msg, owner)

    def _forget_restore(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        if self.restores.get(key) is task:
            del self.restores[key]

    async def _restore_done(self, plan_id: str, session: str) -> None:
        """Wait for a restore of the session under way to end (a request about the session
        comes after it)."""
        task = self.restores.get((plan_id, session))
        if task is not None:
            await asyncio.wait([task])

    async def _connect_onward(self, stage: Stage) -> None:
        """A data connection of the stage's plan to its next stage (which has loaded it)."""
        addr = stage.next_addr
        assert addr is not None and stage.next_capability is not None
        try:
            conn, _ = await connect(addr, self.token, stage.manifest.fingerprint, self.limits,
                                    self.cfg.forward_connect_timeout_s)
        except (ConnectionError, AuthError) as exc:
            raise EdgeliteError(f"next stage {exc}") from exc
        try:
            await conn.send(m.OpenData(id=0, plan_id=stage.plan_id, role="in",
                                       capability=stage.next_capability))
            reply = await asyncio.wait_for(conn.recv(), self.cfg.forward_connect_timeout_s)
            if not isinstance(reply, m.DataReady):
                raise EdgeliteError(f"next stage {addr}: "
                                    f"{getattr(reply, 'message', reply.TYPE)}")
        except BaseException:
            await conn.close()
            raise
        self.data.set_outbound(stage.plan_id, detach(conn.writer))

    # ---- housekeeping -------------------------------------------------------------------
    async def _housekeeping(self) -> None:
        swept = 0.0
        while True:
            await asyncio.sleep(self.cfg.supervise_s)
            await self._supervise()
            await self._release_orphans()
            if n := await self.data.submit(lambda: self.store.expire(self.cfg.session_ttl_s)):
                log.info("expired %d idle sessions", n)
            if time.monotonic() - swept >= min(PART_SWEEP_S, self.cfg.part_ttl_s):
                swept = time.monotonic()
                await asyncio.to_thread(self.store.blobs.clean_parts)

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
                    await self._connect_onward(stage)
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
