"""The stage node: an asyncio TCP server holding a layer range, per-session KV, deployed files.

Control requests (deploy, load, ping, stats, probes) are served on the event loop. A connection
that asks for `data` is handed to the data plane (dataplane.py): one thread that reads steps,
runs the stage's layers and writes each result straight on to the next stage (or, from the last
stage, to the plan's client). A bad frame costs its sender an error reply or its connection,
never the node or another session.
"""

from __future__ import annotations

import asyncio
import logging
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from edgelite.config import NodeConfig, RuntimeConfig, WireLimits
from edgelite.errors import AuthError, EdgeliteError, ProtocolError
from edgelite.net import wire
from edgelite.node.blobs import BlobStore, check_sha
from edgelite.node.dataplane import DataPlane
from edgelite.node.stages import StageStore
from edgelite.probe import prober

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
        self.data = DataPlane(self.name, self.store, self.cfg, self.limits)
        self.server: asyncio.Server | None = None
        self.conns: set[wire.Conn] = set()  # open client connections, closed on shutdown
        self.handlers: set[asyncio.Task] = set()  # their handler tasks (owned by the server)
        self.bad_frames = 0
        # FLOP/s measurements run here, off the loop (forward steps run in the data plane)
        self.compute_pool = ThreadPoolExecutor(1, thread_name_prefix="profile")

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
        self.data.start()

    async def run(self) -> None:
        """Serve until cancelled: the server and the session reaper (the data plane runs in its
        thread). On the way out every connection is closed and its handler has finished."""
        if self.server is None:
            await self.start()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._reaper())
                tg.create_task(self.server.serve_forever())
        finally:
            await self.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
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
                if msg["type"] == "data":
                    await self._data(conn, msg, fingerprint)
                    return  # the connection now belongs to the data plane
                await self._dispatch(conn, msg)
            except EdgeliteError as exc:  # the request was bad; the connection stays usable
                self.bad_frames += 1
                log.info("%s: %s request refused: %s", conn.peer, msg.get("type"), exc)
                await conn.send({"type": "error", "id": msg.get("id"), "message": str(exc)})

    async def _try_send(self, conn: wire.Conn, msg: dict[str, Any]) -> None:
        try:
            await conn.send(msg)
        except (ConnectionError, OSError):
            log.debug("%s: could not send %s", conn.peer, msg.get("type"))

    async def _dispatch(self, conn: wire.Conn, msg: dict[str, Any]) -> None:
        kind, rid = msg["type"], msg.get("id")
        handlers = {"ping": self._ping, "stats": self._stats, "files": self._files,
                    "upload": self._upload, "load": self._load, "end": self._end,
                    "bulk": self._bulk, "profile": self._profile, "probe_link": self._probe_link}
        if kind == "forward":
            raise ProtocolError("forward frames go on a data connection (send type data first)")
        if kind not in handlers:
            raise ProtocolError(f"unknown message type {kind!r}")
        reply = await handlers[kind](msg)
        await conn.send({"type": kind + "_ok", "id": rid, **reply})

    async def _data(self, conn: wire.Conn, msg: dict[str, Any], fingerprint: str | None) -> None:
        """Hand this connection to the data plane: `in` carries steps into this node, `sink`
        takes a plan's results back to its client."""
        role, plan_id = msg.get("role"), msg.get("plan_id")
        self.store.stage_for(plan_id, fingerprint)
        if role not in ("in", "sink"):
            raise ProtocolError(f"data role must be in or sink, not {role!r}")
        if conn.reader._buffer:  # the sender must wait for data_ok before sending steps
            raise ProtocolError("data sent before data_ok")
        sock = wire.detach(conn.writer, self.cfg.forward_timeout_s)  # no read can slip in now
        try:
            sock.sendall(wire.pack({"type": "data_ok", "id": msg.get("id")}))
        except OSError as exc:
            sock.close()
            log.debug("%s: gone before data_ok: %r", conn.peer, exc)
            return
        if role == "in":
            self.data.add_inbound(sock, fingerprint)
        else:
            self.data.set_sink(str(plan_id), sock)

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
        return {"node": self.name, "bad_frames": self.bad_frames + self.data.bad_frames,
                "batches": self.data.batches, "batched_steps": self.data.batched_steps,
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
            await self._connect_onward(next_addr, plan_id, stage.manifest.fingerprint)
        self.store.stages[plan_id] = stage
        log.info("loaded plan %s: layers %d-%d, next %s", plan_id, first, last, next_addr)
        return {"layers": [first, last]}

    async def _end(self, msg: dict[str, Any]) -> dict[str, Any]:
        session = str(msg.get("session"))
        return {"freed": await self.data.submit(lambda: self.store.end(session))}

    async def _connect_onward(self, addr: tuple[str, int], plan_id: str, fingerprint: str) -> None:
        """A data connection to the next stage (which has loaded the plan already)."""
        conn, _ = await wire.connect(addr[0], addr[1], self.token, fingerprint, self.limits,
                                     self.cfg.forward_connect_timeout_s)
        try:
            await conn.send({"type": "data", "id": 0, "plan_id": plan_id, "role": "in"})
            reply = await asyncio.wait_for(conn.recv(), self.cfg.forward_connect_timeout_s)
            if reply.get("type") != "data_ok":
                raise EdgeliteError(f"next stage {addr[0]}:{addr[1]}: {reply.get('message')}")
        except BaseException:
            await conn.close()
            raise
        self.data.set_outbound(addr, wire.detach(conn.writer, self.cfg.forward_timeout_s))

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(min(60.0, self.cfg.session_ttl_s))
            if n := self.store.expire(self.cfg.session_ttl_s):
                log.info("expired %d idle sessions", n)
