"""The node's forward path: one thread that owns the data connections.

A data connection starts like any other (handshake on the event loop), asks for
{type: data, plan_id, role: in | sink} and is then taken off the loop. `in` connections carry
FORWARD frames into this node; the `sink` connection of a plan (opened by its client to the last
stage) receives the RESULT frames. The thread waits on all of them at once, reads a step, runs
the stage's layers and writes the result straight into the next stage's `in` connection (or the
sink): no hand-off between the event loop and a compute thread on the way, which on a phone-class
CPU costs as much as the network hop itself. The event loop keeps answering control requests
(pings, stats, deploys, probes) meanwhile.

A bad frame closes its connection (logged once); a bad step gets an error result, on the
sender's connection when the step itself is malformed, else passed down the chain to the client.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import selectors
import socket
import threading
from collections.abc import Callable
from typing import Any

from edgelite import wire
from edgelite.config import NodeConfig, WireLimits
from edgelite.errors import EdgeliteError, ProtocolError
from edgelite.stage import Stage, StageStore

log = logging.getLogger(__name__)


def check_forward(store: StageStore, msg: dict[str, Any], fingerprint: str | None,
                  limits: WireLimits) -> Stage:
    """Refuse a malformed step up front (on the sender's connection); decodes msg["hidden"]."""
    stage = store.stage_for(msg.get("plan_id"), fingerprint)
    if not isinstance(msg.get("session"), str) or not isinstance(msg.get("start"), int):
        raise ProtocolError("forward needs a string session and an integer start")
    if "error" not in msg:
        hidden = wire.decode_tensor(msg.get("hidden"), limits, "hidden")
        if hidden.ndim != 3 or hidden.shape[2] != stage.manifest.hidden_size:
            raise ProtocolError(f"hidden has shape {list(hidden.shape)}, expected "
                                f"(batch, seq, {stage.manifest.hidden_size})")
        msg["hidden"] = hidden
    return stage


class DataPlane:
    def __init__(self, name: str, store: StageStore, cfg: NodeConfig, limits: WireLimits) -> None:
        self.name, self.store, self.cfg, self.limits = name, store, cfg, limits
        self.sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._todo: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.inbound: dict[socket.socket, str | None] = {}  # -> the fingerprint it was opened for
        self.buffers: dict[socket.socket, bytearray] = {}  # bytes of frames not complete yet
        self.outbound: dict[tuple[str, int], socket.socket] = {}  # next stages' `in` connections
        self.sinks: dict[str, socket.socket] = {}  # plan_id -> its client's sink connection
        self.bad_frames = 0
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="dataplane", daemon=True)

    # ---- called from the event loop (each queues work for the thread) --------------------
    def start(self) -> None:
        self.thread.start()

    def add_inbound(self, sock: socket.socket, fingerprint: str | None) -> None:
        self._call(lambda: self._register(sock, fingerprint))

    def set_outbound(self, addr: tuple[str, int], sock: socket.socket) -> None:
        self._call(lambda: self._replace(self.outbound, addr, sock))

    def set_sink(self, plan_id: str, sock: socket.socket) -> None:
        self._call(lambda: self._set_sink(plan_id, sock))

    def has_outbound(self, addr: tuple[str, int]) -> bool:
        return addr in self.outbound

    async def stop(self) -> None:
        self._stop = True
        self._wake()
        await asyncio.to_thread(self.thread.join, self.cfg.shutdown_timeout_s)

    def _call(self, fn: Callable[[], None]) -> None:
        self._todo.put(fn)
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            log.debug("data plane already stopped")

    # ---- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                for key, _ in self.sel.select(timeout=self.cfg.idle_timeout_s):
                    if key.fileobj is self._wake_r:
                        self._drain_todo()
                    elif key.data == "sink":
                        self._sink_readable(key.fileobj)  # type: ignore[arg-type]
                    else:
                        self._serve(key.fileobj)  # type: ignore[arg-type]
        finally:
            for s in [*self.inbound, *self.outbound.values(), *self.sinks.values()]:
                s.close()
            self.sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _drain_todo(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while not self._todo.empty():
            self._todo.get()()

    def _register(self, sock: socket.socket, fingerprint: str | None) -> None:
        sock.setblocking(False)  # reads never wait; sends below switch to a timeout
        self.inbound[sock] = fingerprint
        self.sel.register(sock, selectors.EVENT_READ, "in")

    def _replace(self, table: dict, key: Any, sock: socket.socket) -> None:
        old = table.get(key)
        table[key] = sock
        if old is not None:
            self._close(old)

    def _set_sink(self, plan_id: str, sock: socket.socket) -> None:
        self._replace(self.sinks, plan_id, sock)
        self.sel.register(sock, selectors.EVENT_READ, "sink")  # only to see it close

    def _close(self, sock: socket.socket) -> None:
        try:
            self.sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        self.inbound.pop(sock, None)
        self.buffers.pop(sock, None)
        for table in (self.outbound, self.sinks):
            for k in [k for k, v in table.items() if v is sock]:
                del table[k]
        sock.close()

    def _sink_readable(self, sock: socket.socket) -> None:
        try:
            sock.setblocking(False)
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the client went away
            self._close(sock)

    def _serve(self, sock: socket.socket) -> None:
        """Read what has arrived (never waiting for the rest of a frame: a slow or stalled
        sender must not hold up the other connections) and handle each complete frame."""
        buf = self.buffers.setdefault(sock, bytearray())
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError as exc:
            log.debug("data connection ended: %r", exc)
            self._close(sock)
            return
        if not chunk:
            if buf:
                self.bad_frames += 1
                log.warning("data connection closed mid-frame (%d bytes held)", len(buf))
            self._close(sock)
            return
        buf += chunk
        while sock in self.inbound and len(buf) >= 4:
            (n,) = wire.LEN.unpack_from(buf)
            try:
                if n > self.limits.max_frame_bytes:
                    raise ProtocolError(f"frame of {n} bytes exceeds the limit "
                                        f"{self.limits.max_frame_bytes}")
                if len(buf) < 4 + n:
                    return
                msg = wire.unpack(bytes(buf[4:4 + n]))
                del buf[:4 + n]
                if msg["type"] != "forward":
                    raise ProtocolError(f"a data connection carries forward frames, not "
                                        f"{msg['type']!r}")
            except ProtocolError as exc:
                self.bad_frames += 1
                log.warning("data connection: %s; closing", exc)
                self._send(sock, {"type": "error", "message": str(exc)})
                self._close(sock)
                return
            self._step(sock, msg)

    def _step(self, sock: socket.socket, msg: dict[str, Any]) -> None:
        try:
            stage = check_forward(self.store, msg, self.inbound.get(sock), self.limits)
        except EdgeliteError as exc:  # the sender gets the refusal, the connection stays
            self.bad_frames += 1
            log.info("forward refused: %s", exc)
            self._send(sock, {"type": "result", "session": msg.get("session"),
                              "step": msg.get("step"), "error": f"{self.name}: {exc}"})
            return
        self._forward(stage, msg)

    def _forward(self, stage: Stage, msg: dict[str, Any]) -> None:
        out = {k: msg[k] for k in ("plan_id", "session", "step") if k in msg}
        try:
            if "error" in msg:
                raise EdgeliteError(msg["error"])  # an upstream stage failed: pass it on
            hidden, start = msg["hidden"], msg["start"]
            kv = self.store.prepare(stage, msg["session"], start, hidden)
            result, kv, ms = self.store.compute(stage, kv, start, hidden)
            self.store.commit(stage, msg["session"], kv, ms)
            out.update(start=start, hidden=wire.encode_tensor(result))
        except EdgeliteError as exc:
            log.info("plan %s session %s: %s", msg.get("plan_id"), msg.get("session"), exc)
            out["error"] = f"{self.name}: {exc}"
        if stage.next_addr:
            dest, kind = self.outbound.get(stage.next_addr), "forward"
        else:
            dest, kind = self.sinks.get(msg["plan_id"]), "result"
        if dest is None:
            log.warning("plan %s: no connection onward; step dropped", msg["plan_id"])
        elif not self._send(dest, {"type": kind, **out}):
            self._close(dest)

    def _send(self, sock: socket.socket, msg: dict[str, Any]) -> bool:
        before = sock.gettimeout()  # inbound sockets stay non-blocking for reads
        try:
            sock.settimeout(self.cfg.forward_timeout_s)
            sock.sendall(wire.pack(msg))
            return True
        except OSError as exc:
            log.warning("could not pass a step on: %r", exc)
            return False
        finally:
            if sock.fileno() != -1:
                sock.settimeout(before)
