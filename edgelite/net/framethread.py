"""A thread that owns non-blocking framed connections: the hot path of steps, off the event loop.

Both ends of a plan's data connections use one: a node's data plane (dataplane.py) and the
client's step plane (stepplane.py). The thread waits on all its connections at once and handles
each complete frame as soon as it is in; a slow or stalled sender holds up nobody, since a read
never waits for the rest of a frame. The event loop hands it work through `call` / `submit`.

Why a thread and not the event loop: a step is ONNX work plus a little framing, and each hand-off
between the loop and a compute thread costs a wake-up of a sleeping thread with cold caches;
on a phone-class CPU that is as much as the network hop itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import queue
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from edgelite.config import WireLimits
from edgelite.errors import EdgeliteError, ProtocolError
from edgelite.net import messages as m
from edgelite.net.frames import LEN, decode, pack
from edgelite.net.schema import Message
from edgelite.net.stepframe import MAGIC

log = logging.getLogger(__name__)
T = TypeVar("T")
QUICKACK = getattr(socket, "TCP_QUICKACK", None)  # Linux (and Android) only


class Outbox:
    """Frames on their way out of a thread's connections: written at once when the kernel
    takes them, else queued per connection and written as the peer reads (POLLOUT), each such
    connection with a deadline to move on. While queued work runs (`corked`), the frames it
    sends wait and go out in one write per connection after it."""

    def __init__(self, poller: select.poll, send_timeout_s: float, name: str) -> None:
        self.poller, self.send_timeout_s, self.name = poller, send_timeout_s, name
        # frames not yet taken by the kernel, and when each such connection must have moved on
        self.queued: dict[socket.socket, deque[memoryview]] = {}
        self.deadline: dict[socket.socket, float] = {}
        self.corked: dict[socket.socket, list[bytes]] | None = None

    def write(self, sock: socket.socket, frames: bytes, what: str) -> bool:
        """False: the connection is broken."""
        data = memoryview(frames)
        if (pending := self.queued.get(sock)) is not None:
            pending.append(data)  # frames stay in order
            return True
        try:
            sent = sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            log.warning("%s: could not send a %s: %r", self.name, what, exc)
            return False
        if sent < len(data):
            self.queued[sock] = deque([data[sent:]])
            self.deadline[sock] = time.monotonic() + self.send_timeout_s
            self.poller.modify(sock, select.POLLIN | select.POLLOUT)
        return True

    def flush(self, sock: socket.socket) -> str | None:
        """Write what the peer takes now; the reason the connection broke, if it did."""
        pending = self.queued[sock]
        try:
            while pending:
                n = sock.send(pending[0])
                pending[0] = pending[0][n:]
                self.deadline[sock] = time.monotonic() + self.send_timeout_s
                if len(pending[0]):
                    return None
                pending.popleft()
        except BlockingIOError:
            return None
        except OSError as exc:
            return f"broken while sending: {exc!r}"
        del self.queued[sock], self.deadline[sock]
        self.poller.modify(sock, select.POLLIN)
        return None

    def forget(self, sock: socket.socket) -> None:
        self.queued.pop(sock, None)
        self.deadline.pop(sock, None)


def _fail(waiting: set[concurrent.futures.Future], name: str) -> None:
    """Submitted work a thread will not run (it ended) fails at once, naming why."""
    for fut in list(waiting):
        try:
            fut.set_exception(EdgeliteError(f"the {name} thread ended"))
        except concurrent.futures.InvalidStateError:
            pass  # (finished meanwhile)


class FrameThread:
    RECV_BYTES = 64 * 1024  # per read; below malloc's mmap threshold
    LONE_STEPS = False  # whether on_lone_step may take steps (subclasses that handle them)

    def __init__(self, name: str, limits: WireLimits, send_timeout_s: float,
                 queued_call_timeout_s: float, shutdown_timeout_s: float) -> None:
        self.limits = limits
        self.send_timeout_s = send_timeout_s
        self.queued_call_timeout_s = queued_call_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        # poll() over the few connections: no Python between the wake-up and the read
        self.poller = select.poll()
        self.socks: dict[int, socket.socket] = {}  # registered fd -> its connection
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self.poller.register(self._wake_r, select.POLLIN)
        self._wake_fd = self._wake_r.fileno()
        self._todo: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.roles: dict[socket.socket, str] = {}  # open connections (a plain dict: hot path)
        self.buffers: dict[socket.socket, bytearray] = {}  # bytes of frames not complete yet
        self.out = Outbox(self.poller, send_timeout_s, name)
        self.partial_since: dict[socket.socket, float] = {}  # when a frame began and is not whole
        self.bad_frames = 0
        self.failures = 0  # frames or idle work whose handler raised (a bug; the thread went on)
        self._stop = False
        self._rbuf = bytearray(self.RECV_BYTES)  # each read lands here, then is taken at once
        self._rview = memoryview(self._rbuf)
        self._lone = False  # the current wait brought input on one connection only
        self.acks_due: list[socket.socket] = []  # read this round (see delay_acks)
        # submitted work not finished yet: failed when the thread ends (it would never run)
        self._waiting: set[concurrent.futures.Future] = set()
        self._ended = False  # set as the thread ends, before it fails what is waiting
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ---- for subclasses ------------------------------------------------------------------
    def on_frame(self, sock: socket.socket, msg: Message, t_in: float) -> None:
        raise NotImplementedError

    def on_lone_step(self, sock: socket.socket, body: memoryview, t_in: float) -> bool:
        """A binary step frame that is the only input of this wait (one frame, on one
        connection): the subclass may handle it from its raw bytes and return True; False
        (the default) handles it as any frame."""
        return False

    def on_bad_frame(self, sock: socket.socket, exc: ProtocolError, fatal: bool) -> None:
        """A frame that is not a valid message: the sender gets an error naming what was wrong.
        `fatal`: the stream cannot be followed any further (a length over the limit), so the
        connection is closed too."""
        self.bad_frames += 1
        log.info("%s: bad frame: %s%s", self.thread.name, exc, "; closing" if fatal else "")
        if not self.send(sock, m.Error(message=str(exc))):
            self.close_conn(sock, "broken while sending")
        elif fatal:
            self.close_conn(sock, f"bad frame: {exc}")

    def on_closed(self, sock: socket.socket, reason: str) -> None:
        """The peer closed (or broke) the connection; it is already unregistered and closed."""

    def next_timeout(self) -> float | None:
        """How long the thread may wait for input before `on_idle` (None: until woken)."""
        return None

    def on_idle(self) -> None:
        """Runs after every wait, once the input it brought is read: timers, queued steps."""

    def cleanup(self) -> None:
        """On the thread, as it ends."""

    # ---- called from the event loop ------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def call(self, fn: Callable[[], None]) -> None:
        """Run fn on the thread, in order with the frames it handles."""
        self._todo.put(fn)
        try:
            self._wake_w.send(b"x")
        except OSError:
            log.debug("%s already stopped", self.thread.name)

    async def submit(self, fn: Callable[[], T]) -> T:
        """Run fn on the thread and wait for its result."""
        if not self.thread.is_alive():
            raise EdgeliteError(f"the {self.thread.name} thread is not running")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except Exception as exc:  # noqa: BLE001 - handed to the awaiting caller
                    fut.set_exception(exc)

        self._waiting.add(fut)
        fut.add_done_callback(self._waiting.discard)
        self.call(run)
        if self._ended:  # (it ended as the work was queued: nothing will run it)
            _fail(self._waiting, self.thread.name)
        return await asyncio.wait_for(asyncio.wrap_future(fut), self.queued_call_timeout_s)

    async def stop(self) -> None:
        if not self.thread.is_alive():
            return
        self._stop = True
        self.call(lambda: None)
        await asyncio.to_thread(self.thread.join, self.shutdown_timeout_s)

    # ---- on the thread -------------------------------------------------------------------
    def add(self, sock: socket.socket, role: str) -> None:
        sock.setblocking(False)  # reads never wait; `send` waits only for a frame's tail
        self.poller.register(sock, select.POLLIN)
        self.socks[sock.fileno()] = sock
        self.roles[sock] = role

    def role(self, sock: socket.socket) -> str | None:
        """What the connection is to the subclass (None: not open on this thread)."""
        return self.roles.get(sock)

    def send(self, sock: socket.socket, *msgs: Message) -> bool:
        """Queue frames, in one write (steps in their binary layout: stepframe.py); a step's
        activations usually go to the kernel at once. The rest of a big frame goes out as the
        peer reads, without holding up other connections; a peer that takes nothing for the
        send timeout loses its connection. False: broken already."""
        data = pack(msgs[0]) if len(msgs) == 1 else b"".join(pack(x) for x in msgs)
        return self.send_frames(sock, data, msgs[0].TYPE)

    def send_frames(self, sock: socket.socket, data: bytes, what: str) -> bool:
        """`send` of frames already packed (`what` names them in a log line)."""
        if self.out.corked is not None:  # queued work is running: its frames go out together
            self.out.corked.setdefault(sock, []).append(data)
            return True
        return self._write(sock, data, what)

    def _write(self, sock: socket.socket, frames: bytes, what: str) -> bool:
        return self.out.write(sock, frames, what)

    def _wait_s(self) -> float | None:
        waits = [w for w in (self.next_timeout(),) if w is not None]
        now = time.monotonic()
        if self.out.deadline:
            waits.append(max(0.0, min(self.out.deadline.values()) - now))
        if self.partial_since:
            body_s = self.limits.frame_body_timeout_s
            waits.append(max(0.0, min(self.partial_since.values()) + body_s - now))
        return min(waits) if waits else None

    def _expire(self) -> None:
        """Close connections whose peer stopped reading our frames, or stopped mid-frame."""
        now = time.monotonic()
        for sock in [s for s, t in self.out.deadline.items() if t <= now]:
            self.close_conn(sock, f"peer took nothing for {self.send_timeout_s:g} s")
        body_s = self.limits.frame_body_timeout_s
        for sock in [s for s, t in self.partial_since.items() if t + body_s <= now]:
            self.bad_frames += 1
            self.close_conn(sock, f"a frame stayed incomplete for {body_s:g} s")

    def close_conn(self, sock: socket.socket, reason: str = "closed here") -> None:
        corked = self.out.corked
        frames = corked.pop(sock, None) if corked is not None else None
        if frames and self.role(sock) is not None:  # what was sent before the close goes first
            self._write(sock, b"".join(frames), "frame")
        if self.roles.pop(sock, None) is None:
            return  # closed already
        # (by its registered fd: a socket closed elsewhere already has none)
        fd = next((f for f, s in self.socks.items() if s is sock), None)
        if fd is not None:
            del self.socks[fd]
            self.poller.unregister(fd)
        self.buffers.pop(sock, None)
        self.partial_since.pop(sock, None)
        self.out.forget(sock)
        sock.close()
        self.on_closed(sock, reason)

    def _run(self) -> None:
        try:
            while not self._stop:
                wait = self._wait_s()
                ready = self.poller.poll(None if wait is None else math.ceil(wait * 1e3))
                self._lone = len(ready) == 1
                for fd, events in ready:
                    if fd == self._wake_fd:
                        self._drain_todo()
                        continue
                    sock = self.socks.get(fd)
                    if sock is None:  # closed earlier this round
                        continue
                    if events & select.POLLNVAL:  # closed elsewhere while registered here
                        self.close_conn(sock, "closed outside the thread")
                        continue
                    if events & ~select.POLLIN and sock in self.out.queued:  # writable, or failed
                        if (broken := self.out.flush(sock)) is not None:
                            self.close_conn(sock, broken)
                    if events & ~select.POLLOUT and sock in self.roles:  # readable, or closed
                        self._read(sock)
                if self.out.deadline or self.partial_since:
                    self._expire()
                self._guarded(self.on_idle, "idle work")
                if self.acks_due:
                    delay_acks(self.acks_due, self.roles)
        except Exception:
            log.exception("%s failed", self.thread.name)
            raise
        finally:
            for sock in list(self.roles):
                self.close_conn(sock, "shutting down")
            self.cleanup()
            self._wake_r.close()
            self._wake_w.close()
            self._ended = True
            _fail(self._waiting, self.thread.name)

    @property
    def stopping(self) -> bool:
        return self._stop

    def _guarded(self, fn: Callable[[], None], what: str) -> None:
        """Run a handler; if it raises anyway (a bug), count and log it and go on: the
        connections and every other session stay."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the thread must outlive any one handler
            self._failed(what, exc)

    def _failed(self, what: str, exc: Exception) -> None:
        self.failures += 1
        log.error("%s: handling %s failed: %r", self.thread.name, what, exc)
        log.debug("%s: handling %s failed", self.thread.name, what, exc_info=exc)

    def _drain_todo(self) -> None:
        try:  # (a wake-up has at least one byte to read: no exception raised in the usual case)
            while len(self._wake_r.recv(4096)) == 4096:
                pass
        except BlockingIOError:
            pass
        self.out.corked = {}
        try:
            while not self._todo.empty():
                self._guarded(self._todo.get(), "queued work")
        finally:
            corked, self.out.corked = self.out.corked, None
            for sock, frames in corked.items():
                if self.role(sock) is not None and not self._write(sock, b"".join(frames), "frame"):
                    self.close_conn(sock, "broken while sending")

    def _read(self, sock: socket.socket) -> None:
        """Take what has arrived and handle each complete frame."""
        buf = self.buffers.get(sock)
        if buf is None:
            buf = self.buffers[sock] = bytearray()
        try:
            got = sock.recv_into(self._rbuf)
        except BlockingIOError:
            return
        except OSError as exc:
            self.close_conn(sock, f"connection broken: {exc!r}")
            return
        t_in = time.perf_counter()  # what this read completes is here: time spent on it starts
        if QUICKACK is not None:
            self.acks_due.append(sock)
        if (self.LONE_STEPS and self._lone and not buf and got > 4 and self._rbuf[4] == MAGIC
                and got == 4 + LEN.unpack_from(self._rbuf)[0]):  # exactly one step frame
            with self._rview[4:got] as body:
                try:
                    if self.on_lone_step(sock, body, t_in):
                        return
                except Exception as exc:  # noqa: BLE001 - see _guarded
                    self._failed("a step frame", exc)
                    return
        if not got:
            if buf:
                self.bad_frames += 1
                log.warning("data connection closed mid-frame (%d bytes held)", len(buf))
            self.close_conn(sock, "connection closed" + (" mid-frame" if buf else ""))
            return
        buf += self._rview[:got]
        while self.buffers.get(sock) is buf and len(buf) >= 4:
            (n,) = LEN.unpack_from(buf)
            if n > self.limits.max_frame_bytes:
                self.on_bad_frame(sock, ProtocolError(f"frame of {n} bytes exceeds the limit "
                                                      f"{self.limits.max_frame_bytes}"), fatal=True)
                return
            if len(buf) < 4 + n:
                self.partial_since.setdefault(sock, time.monotonic())
                return
            self.partial_since.pop(sock, None)
            msg, bad = parse_head(buf, n, self.limits)
            del buf[:4 + n]
            if bad is not None:  # a whole frame that is wrong: refuse it, read on
                self.on_bad_frame(sock, bad, fatal=False)
                continue
            try:
                self.on_frame(sock, msg, t_in)
            except Exception as exc:  # noqa: BLE001 - see _guarded
                self._failed(f"a {msg.TYPE} frame", exc)


def parse_head(buf: bytearray, n: int,
               limits: WireLimits) -> tuple[Message, None] | tuple[None, ProtocolError]:
    """The frame at the head of buf (n bytes after its length) as a message, without
    copying it. The views on buf are released before returning, even when the error's
    traceback still refers to them (buf is resized next)."""
    whole = memoryview(buf)
    body = whole[4:4 + n]
    try:
        return decode(body, limits), None
    except ProtocolError as exc:
        return None, exc
    finally:
        body.release()
        whole.release()


def delay_acks(socks: list[socket.socket], open_: dict[socket.socket, str]) -> None:
    """After the round's work (its sends are out): the connections read this round ack
    their next data late, with the peer's next ack or the kernel's delayed-ack timer,
    instead of at once. Steps flow one way on a data connection, so each step would
    otherwise cost a bare ack packet, handled inside the receiver's read on the hop's
    path (the mode does not last: it is set again after every read)."""
    for sock in socks:
        if sock in open_:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, QUICKACK, 0)  # type: ignore[arg-type]
            except OSError:  # not TCP (a socketpair in tests), or closing
                pass
    socks.clear()
