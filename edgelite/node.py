"""The stage node: an asyncio TCP server holding a layer range, per-session KV, deployed files.

Frames are read on the event loop; FORWARD steps go through one queue to one worker that runs
ONNX in a thread, then the result goes straight on to the next stage (or, from the last stage,
to the client that subscribed to the plan). A bad frame costs its sender an error reply or its
connection, never the node or another session.
"""

from __future__ import annotations

import asyncio
import logging
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from edgelite import prober, wire
from edgelite.blobstore import BlobStore, check_sha
from edgelite.config import NodeConfig, RuntimeConfig, WireLimits
from edgelite.errors import AuthError, EdgeliteError, ProtocolError
from edgelite.stage import Stage, StageStore

log = logging.getLogger(__name__)


@dataclass
class Node:
    cfg: NodeConfig
    token: str
    data_dir: Any
    name: str = field(default_factory=platform.node)
    limits: WireLimits = field(default_factory=WireLimits)

    def __post_init__(self) -> None:
        self.store = StageStore(BlobStore(self.data_dir), self.cfg.kv_budget_bytes,
                                RuntimeConfig(threads=self.cfg.threads))
        self.queue: asyncio.Queue[tuple[Stage, dict[str, Any]]] = asyncio.Queue()
        self.sinks: dict[str, wire.Conn] = {}  # plan_id -> the client receiving final hidden states
        self.next_conns: dict[tuple[str, int], wire.Conn] = {}
        self.server: asyncio.Server | None = None
        self.conns: set[wire.Conn] = set()  # open client connections, closed on shutdown
        self.handlers: set[asyncio.Task] = set()  # their handler tasks (owned by the server)
        self.bad_frames = 0
        # One long-lived thread runs every ONNX step: the same thread each time keeps ORT's
        # per-thread state warm (measured: default-pool hops cost ~0.5 ms per stage).
        self.compute_pool = ThreadPoolExecutor(1, thread_name_prefix="onnx")

    @property
    def port(self) -> int:
        return wire.bound_port(self.server)

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, self.cfg.host, self.cfg.port)
        loop = asyncio.get_running_loop()
        try:  # the UDP echo for loss probes shares the TCP port number when it is free
            self.udp, _ = await loop.create_datagram_endpoint(
                lambda: prober.UdpEcho(self.token), local_addr=(self.cfg.host, self.port))
        except OSError:
            self.udp, _ = await loop.create_datagram_endpoint(
                lambda: prober.UdpEcho(self.token), local_addr=(self.cfg.host, 0))
        self.udp_port = self.udp.get_extra_info("sockname")[1]

    async def run(self) -> None:
        """Serve until cancelled: the server, the forward worker and the session reaper. On the
        way out every connection is closed and its handler has finished."""
        if self.server is None:
            await self.start()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._worker())
                tg.create_task(self._reaper())
                tg.create_task(self.server.serve_forever())
        finally:
            await self.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.udp.close()
        for conn in [*self.conns, *self.next_conns.values()]:
            conn.writer.close()
        handlers = [t for t in self.handlers if t is not asyncio.current_task()]
        if handlers:
            await asyncio.wait(handlers, timeout=self.cfg.handshake_timeout_s)
        self.compute_pool.shutdown(wait=False)

    # ---- connections -------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = writer.get_extra_info("peername")[:2]
        peer = f"{host}:{port}"
        conn = wire.Conn(reader, writer, self.limits, peer)
        me = asyncio.current_task()
        self.conns.add(conn)
        if me is not None:
            self.handlers.add(me)
        try:
            fps = sorted({s.manifest.fingerprint for s in self.store.stages.values()})
            extra = {"udp_port": self.udp_port, "port": self.port}
            auth = await asyncio.wait_for(
                wire.server_handshake(conn, self.token, self.name, fps, extra),
                self.cfg.handshake_timeout_s)
            await self._serve(conn, auth.get("fingerprint"))
        except (AuthError, ProtocolError) as exc:
            self.bad_frames += 1
            log.warning("%s: %s; closing", peer, exc)
            await self._try_send(conn, {"type": "error", "message": str(exc)})
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            log.debug("%s: connection ended: %r", peer, exc)
        finally:
            for plan, sink in list(self.sinks.items()):
                if sink is conn:
                    del self.sinks[plan]
            self.conns.discard(conn)
            self.handlers.discard(me)  # type: ignore[arg-type]
            await conn.close()

    async def _serve(self, conn: wire.Conn, fingerprint: str | None) -> None:
        while True:
            try:
                msg = await asyncio.wait_for(conn.recv(), self.cfg.idle_timeout_s)
            except asyncio.IncompleteReadError:
                return  # clean close between frames
            try:
                await self._dispatch(conn, msg, fingerprint)
            except EdgeliteError as exc:  # the request was bad; the connection stays usable
                self.bad_frames += 1
                log.info("%s: %s request refused: %s", conn.peer, msg.get("type"), exc)
                if msg["type"] == "forward":  # the sender waits for a result, not a reply
                    await conn.send({"type": "result", "session": msg.get("session"),
                                     "step": msg.get("step"), "error": f"{self.name}: {exc}"})
                else:
                    await conn.send({"type": "error", "id": msg.get("id"), "message": str(exc)})

    async def _try_send(self, conn: wire.Conn, msg: dict[str, Any]) -> None:
        try:
            await conn.send(msg)
        except (ConnectionError, OSError):
            log.debug("%s: could not send %s", conn.peer, msg.get("type"))

    async def _dispatch(self, conn: wire.Conn, msg: dict[str, Any], fingerprint: str | None) -> None:
        kind, rid = msg["type"], msg.get("id")
        if kind == "forward":
            await self.queue.put(self._check_forward(msg, fingerprint))
            return
        handlers = {"ping": self._ping, "stats": self._stats, "files": self._files,
                    "upload": self._upload, "load": self._load, "end": self._end,
                    "bulk": self._bulk, "profile": self._profile, "probe_link": self._probe_link}
        if kind == "subscribe":
            self._stage(msg)
            self.sinks[msg["plan_id"]] = conn
            reply: dict[str, Any] = {}
        elif kind in handlers:
            reply = await handlers[kind](msg)
        else:
            raise ProtocolError(f"unknown message type {kind!r}")
        await conn.send({"type": kind + "_ok", "id": rid, **reply})

    def _check_forward(self, msg: dict[str, Any],
                       fingerprint: str | None) -> tuple[Stage, dict[str, Any]]:
        """Refuse a malformed step up front, on the sender's own connection."""
        stage = self._stage(msg)
        if fingerprint is not None and stage.manifest.fingerprint != fingerprint:
            raise ProtocolError(f"plan {stage.plan_id} serves model {stage.manifest.fingerprint}, "
                                f"this connection was opened for {fingerprint}")
        if not isinstance(msg.get("session"), str) or not isinstance(msg.get("start"), int):
            raise ProtocolError("forward needs a string session and an integer start")
        if "error" not in msg:
            hidden = wire.decode_tensor(msg.get("hidden"), self.limits, "hidden")
            if hidden.ndim != 3 or hidden.shape[2] != stage.manifest.hidden_size:
                raise ProtocolError(f"hidden has shape {list(hidden.shape)}, expected "
                                    f"(batch, seq, {stage.manifest.hidden_size})")
            msg["hidden"] = hidden
        return stage, msg

    def _stage(self, msg: dict[str, Any]) -> Stage:
        stage = self.store.stages.get(msg.get("plan_id"))  # type: ignore[arg-type]
        if stage is None:
            raise ProtocolError(f"plan_id {msg.get('plan_id')!r} is not loaded on this node")
        return stage

    # ---- control requests --------------------------------------------------------------
    async def _ping(self, msg: dict[str, Any]) -> dict[str, Any]:
        # the receive time on this node's clock: senders get one-way delay variation from it
        return {"t": msg.get("t"), "rt": time.monotonic()}

    async def _bulk(self, msg: dict[str, Any]) -> dict[str, Any]:
        data, back = msg.get("data"), msg.get("reply_bytes", 0)
        if not isinstance(back, int) or not 0 <= back <= self.cfg.bulk_reply_max_bytes:
            raise ProtocolError(f"bulk reply_bytes must be 0-{self.cfg.bulk_reply_max_bytes}")
        return {"bytes": len(data) if isinstance(data, bytes) else 0, "data": bytes(back)}

    async def _profile(self, msg: dict[str, Any]) -> dict[str, Any]:
        hidden, layer = msg.get("hidden_size"), msg.get("layer")
        flops = await asyncio.get_running_loop().run_in_executor(
            self.compute_pool, self.store.measure_flops, hidden if isinstance(hidden, int) else 0,
            layer if isinstance(layer, dict) else None)
        budget = {} if self.cfg.memory_budget_bytes is None else {
            "memory_budget_bytes": self.cfg.memory_budget_bytes}
        return {"node": self.name, "threads": self.cfg.threads, **flops, **prober.host_profile(),
                **budget}

    async def _probe_link(self, msg: dict[str, Any]) -> dict[str, Any]:
        host, port = msg.get("host"), msg.get("port")
        if not isinstance(host, str) or not isinstance(port, int):
            raise ProtocolError("probe_link needs host and port")
        udp = msg.get("udp_port")
        stats = await prober.probe_peer(host, port, udp if isinstance(udp, int) else None,
                                        self.token, prober.ProbeConfig(**msg.get("config", {})))
        return {"link": stats.to_json()}

    async def _stats(self, _msg: dict[str, Any]) -> dict[str, Any]:
        return {"node": self.name, "queue": self.queue.qsize(), "bad_frames": self.bad_frames,
                **self.store.stats()}

    async def _files(self, msg: dict[str, Any]) -> dict[str, Any]:
        shas = [check_sha(s) for s in msg.get("sha256", [])]
        b = self.store.blobs
        return {"have": [s for s in shas if b.has(s)], "partial": {s: b.partial(s) for s in shas}}

    async def _upload(self, msg: dict[str, Any]) -> dict[str, Any]:
        sha, data = check_sha(msg.get("sha256")), msg.get("data")
        offset, total = msg.get("offset"), msg.get("total")
        if not isinstance(data, bytes) or not isinstance(offset, int) or not isinstance(total, int):
            raise ProtocolError("upload needs bytes data and integer offset and total")
        held = await asyncio.to_thread(self.store.blobs.append, sha, offset, total, data)
        return {"held": held, "complete": held == total}

    async def _load(self, msg: dict[str, Any]) -> dict[str, Any]:
        plan_id, first, last = msg.get("plan_id"), msg.get("first"), msg.get("last")
        if not isinstance(plan_id, str) or not isinstance(first, int) or not isinstance(last, int):
            raise ProtocolError("load needs plan_id, first and last")
        nxt = msg.get("next")
        next_addr = (str(nxt[0]), int(nxt[1])) if nxt else None
        stage = await asyncio.to_thread(self.store.build, plan_id, msg.get("manifest") or {},
                                        first, last, next_addr)
        if next_addr:
            await self._next_conn(next_addr, stage.manifest.fingerprint)
        self.store.stages[plan_id] = stage
        log.info("loaded plan %s: layers %d-%d, next %s", plan_id, first, last, next_addr)
        return {"layers": [first, last]}

    async def _end(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"freed": self.store.end(str(msg.get("session")))}

    async def _next_conn(self, addr: tuple[str, int], fingerprint: str) -> wire.Conn:
        conn = self.next_conns.get(addr)
        if conn is None or conn.writer.is_closing():
            conn, _ = await wire.connect(addr[0], addr[1], self.token, fingerprint, self.limits,
                                         self.cfg.forward_connect_timeout_s)
            self.next_conns[addr] = conn
        return conn

    # ---- the forward path --------------------------------------------------------------
    async def _worker(self) -> None:
        while True:
            stage, msg = await self.queue.get()
            try:
                await self._forward(stage, msg)
            except (TimeoutError, ConnectionError, OSError) as exc:
                log.warning("plan %s: could not pass a step on: %r", msg.get("plan_id"), exc)

    async def _forward(self, stage: Stage, msg: dict[str, Any]) -> None:
        out = {k: msg[k] for k in ("plan_id", "session", "step") if k in msg}
        try:
            if "error" in msg:
                raise EdgeliteError(msg["error"])  # an upstream stage failed: pass it on
            hidden, start = msg["hidden"], msg["start"]
            kv = self.store.prepare(stage, msg["session"], start, hidden)
            result, kv, ms = await asyncio.get_running_loop().run_in_executor(
                self.compute_pool, self.store.compute, stage, kv, start, hidden)
            self.store.commit(stage, msg["session"], kv, ms)
            out.update(start=start, hidden=wire.encode_tensor(result))
        except EdgeliteError as exc:
            log.info("plan %s session %s: %s", msg.get("plan_id"), msg.get("session"), exc)
            out["error"] = f"{self.name}: {exc}"
        if stage.next_addr:
            conn = await self._next_conn(stage.next_addr, stage.manifest.fingerprint)
            await conn.send({"type": "forward", **out})
        elif (sink := self.sinks.get(msg["plan_id"])) is not None:
            await sink.send({"type": "result", **out})
        else:
            log.warning("plan %s: no client subscribed; result dropped", msg["plan_id"])

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(min(60.0, self.cfg.session_ttl_s))
            if n := self.store.expire(self.cfg.session_ttl_s):
                log.info("expired %d idle sessions", n)
