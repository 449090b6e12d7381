"""Frames: a 4-byte big-endian length, then one msgpack map (a message, see messages.py), or
for the steps of a plan (Forward, Result) a binary body (stepframe.py).

`Conn` is one framed connection on the event loop. Before the handshake has authenticated the
peer, a frame may be only `max_handshake_frame_bytes` long: nothing large is read for a
stranger. Reads of the rest of a frame have a deadline, so a peer that stops mid-frame cannot
hold a reader forever.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from edgelite.config import WireLimits
from edgelite.errors import EdgeliteError, ProtocolError, StreamError
from edgelite.net import stepframe
from edgelite.net.budget import ByteBudget
from edgelite.net.schema import Message, parse
from edgelite.net.stepframe import LEN  # the frame length prefix (re-exported)


def pack(msg: Message) -> bytes:
    """A whole frame: steps in their binary layout (stepframe.py), everything else msgpack."""
    if stepframe.carries(msg):
        body = stepframe.encode(msg)  # type: ignore[arg-type]
    else:
        body = msgpack.packb(msg.to_wire(), use_bin_type=True)
    return LEN.pack(len(body)) + body


def decode(body: bytes | bytearray | memoryview, limits: WireLimits) -> Message:
    """A frame's body as a checked message, whichever codec wrote it. Anything wrong with it
    is a ProtocolError (the codecs check every field; should one slip through, the error it
    raises is still the frame's, never the reader's)."""
    try:
        if stepframe.is_step(body):
            return stepframe.parse(body, limits)
        return parse(unpack(body), limits)
    except ProtocolError:
        raise
    except (ValueError, TypeError, OverflowError, struct.error, RecursionError) as exc:
        raise ProtocolError(f"malformed frame: {str(exc)[:120]}") from exc


def unpack(body: bytes | memoryview) -> dict[str, Any]:
    """A frame's body as a map (not yet checked against the schema)."""
    try:
        frame = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException, TypeError, RecursionError) as exc:
        raise ProtocolError(f"frame is not valid msgpack: {str(exc)[:120]}") from exc
    if type(frame) is not dict:
        raise ProtocolError("frame is not a map")
    return frame


async def read_frame(reader: asyncio.StreamReader, max_bytes: int, body_timeout_s: float,
                     budget: ByteBudget | None = None) -> bytes:
    """One frame's body; EOF before a frame starts raises asyncio.IncompleteReadError (a clean
    close). The body must arrive within `body_timeout_s` once its length is in (and, with a
    `budget`, once its bytes are taken from it: the caller gives them back)."""
    head = await reader.readexactly(4)
    (n,) = LEN.unpack(head)
    if n > max_bytes:
        raise StreamError(f"frame of {n} bytes exceeds the limit of {max_bytes}")
    if budget is not None:
        await budget.take(n)
    try:
        return await asyncio.wait_for(reader.readexactly(n), body_timeout_s)
    except BaseException as exc:
        if budget is not None:  # the frame will not be held: its bytes go back
            budget.give(n)
        if isinstance(exc, asyncio.IncompleteReadError):
            raise StreamError(f"connection closed mid-frame ({len(exc.partial)} of {n} bytes)") from exc
        if isinstance(exc, TimeoutError):
            raise StreamError(f"a frame of {n} bytes did not arrive within {body_timeout_s:g} s") from exc
        raise


def detach(writer: asyncio.StreamWriter) -> socket.socket:
    """Take a connection away from the event loop: a socket for a thread of its own (the loop's
    transport is closed; the duplicate keeps the connection open)."""
    fd = os.dup(writer.get_extra_info("socket").fileno())
    sock = socket.socket(fileno=fd)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    writer.transport.abort()
    return sock


@dataclass(eq=False)  # identity: connections go in sets
class Conn:
    """One framed connection; `send` is safe from many tasks (writes are not interleaved)."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    limits: WireLimits
    peer: str = "?"
    authenticated: bool = False  # large frames only once the handshake has succeeded
    # frames read once authenticated take their bytes from this (the caller gives them back)
    budget: ByteBudget | None = None

    def __post_init__(self) -> None:
        self._lock = asyncio.Lock()

    async def send(self, msg: Message) -> None:
        data = pack(msg)
        async with self._lock:
            if self.writer.is_closing():  # uvloop raises RuntimeError on a closed transport
                raise ConnectionResetError(f"{self.peer}: connection closed")
            self.writer.write(data)
            await self.writer.drain()

    async def _body(self) -> bytes:
        if not self.authenticated:
            return await read_frame(self.reader, self.limits.max_handshake_frame_bytes,
                                    self.limits.frame_body_timeout_s)
        return await read_frame(self.reader, self.limits.max_frame_bytes,
                                self.limits.frame_body_timeout_s, self.budget)

    async def recv_frame(self) -> dict[str, Any]:
        """The next frame as a map (for the few callers that route before parsing)."""
        return unpack(await self._body())

    async def recv_body(self) -> bytes:
        """The next frame's body, unparsed (`unpack` it; its length is what it holds)."""
        return await self._body()

    async def recv(self) -> Message:
        """The next frame as a checked message."""
        return decode(await self._body(), self.limits)

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


def bound_port(server: asyncio.Server | None) -> int:
    """The TCP port a started server listens on (port 0 picks a free one)."""
    if server is None:
        raise RuntimeError("the server has not been started")
    return server.sockets[0].getsockname()[1]


async def listen(handler: Any, host: str, port: int) -> asyncio.Server:
    """asyncio.start_server, with a one-line error when the address cannot be had."""
    try:
        return await asyncio.start_server(handler, host, port)
    except OSError as exc:
        raise listen_error(host, port, exc) from None


def listen_error(host: str, port: int, exc: OSError, flag: str = "--port") -> EdgeliteError:
    """Why a server socket could not be bound, in one line (`flag`: the option that sets it)."""
    why = {errno.EADDRINUSE: "the port is in use (another node or program has it; pick another "
                             f"port with {flag}, or 0 for any free one)",
           errno.EADDRNOTAVAIL: "this device has no such address (--host)",
           errno.EACCES: "permission denied (ports below 1024 need privileges)"}.get(
        exc.errno or 0, exc.strerror or str(exc))
    return EdgeliteError(f"cannot listen on {host}:{port}: {why}")
