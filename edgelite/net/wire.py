"""Frames, tensors and the handshake.

A frame is a 4-byte big-endian length and one msgpack map with a `type` field. Tensors travel as
{dtype, shape, data}; limits are checked before anything is allocated. The handshake is mutual
HMAC-SHA256 challenge-response over the shared cluster token.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from edgelite.config import WireLimits
from edgelite.errors import AuthError, ProtocolError

PROTOCOL_VERSION = 1
DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32}
ITEMSIZE = {k: np.dtype(v).itemsize for k, v in DTYPES.items()}
LEN = struct.Struct(">I")  # the frame length prefix


def encode_tensor(a: np.ndarray) -> dict[str, Any]:
    a = np.ascontiguousarray(a)
    if a.dtype.name not in DTYPES:
        raise ProtocolError(f"dtype {a.dtype.name} cannot be sent; known: {', '.join(DTYPES)}")
    return {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.data.cast("B")}


def decode_tensor(obj: Any, limits: WireLimits, name: str = "tensor") -> np.ndarray:
    """Zero-copy view of a received tensor, after checking dtype, shape and length."""
    if not isinstance(obj, dict) or "dtype" not in obj or "shape" not in obj or "data" not in obj:
        raise ProtocolError(f"{name}: expected {{dtype, shape, data}}")
    dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if dtype not in DTYPES:
        raise ProtocolError(f"{name}: unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > limits.max_tensor_dims:
        raise ProtocolError(f"{name}: bad shape {shape!r}")
    for d in shape:
        if not isinstance(d, int) or d < 0:
            raise ProtocolError(f"{name}: bad shape {shape!r}")
    n = math.prod(shape)
    if n > limits.max_tensor_elements:
        raise ProtocolError(f"{name}: {n} elements exceed the limit {limits.max_tensor_elements}")
    if not isinstance(data, bytes) or len(data) != n * ITEMSIZE[dtype]:
        got = len(data) if isinstance(data, bytes) else type(data).__name__
        raise ProtocolError(f"{name}: shape {shape} x {dtype} needs {n * ITEMSIZE[dtype]} bytes, "
                            f"got {got}")
    return np.frombuffer(data, DTYPES[dtype]).reshape(shape)


def pack(msg: dict[str, Any]) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return LEN.pack(len(body)) + body


def unpack(body: bytes) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise ProtocolError(f"frame is not valid msgpack: {exc}") from exc
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ProtocolError("frame is not a map with a string 'type'")
    return msg


async def read_frame(reader: asyncio.StreamReader, limits: WireLimits) -> dict[str, Any]:
    """One frame; EOF before a frame starts raises asyncio.IncompleteReadError (a clean close)."""
    head = await reader.readexactly(4)
    (n,) = LEN.unpack(head)
    if n > limits.max_frame_bytes:
        raise ProtocolError(f"frame of {n} bytes exceeds the limit {limits.max_frame_bytes}")
    try:
        body = await reader.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(f"connection closed mid-frame ({len(exc.partial)} of {n} bytes)") from exc
    return unpack(body)


def detach(writer: asyncio.StreamWriter, timeout: float) -> socket.socket:
    """Take a connection away from the event loop: a blocking socket for a thread of its own
    (the loop's transport is closed; the duplicate keeps the connection open)."""
    fd = os.dup(writer.get_extra_info("socket").fileno())
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    sock.settimeout(timeout)
    writer.transport.abort()
    return sock


@dataclass(eq=False)  # identity: connections go in sets
class Conn:
    """One framed connection; `send` is safe from many tasks (writes are not interleaved)."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    limits: WireLimits
    peer: str = "?"

    def __post_init__(self) -> None:
        self._lock = asyncio.Lock()

    async def send(self, msg: dict[str, Any]) -> None:
        data = pack(msg)
        async with self._lock:
            if self.writer.is_closing():  # uvloop raises RuntimeError on a closed transport
                raise ConnectionResetError(f"{self.peer}: connection closed")
            self.writer.write(data)
            await self.writer.drain()

    async def recv(self) -> dict[str, Any]:
        return await read_frame(self.reader, self.limits)

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


def _mac(token: str, nonce: bytes, role: bytes) -> bytes:
    return hmac.new(token.encode(), role + nonce, hashlib.sha256).digest()


async def server_handshake(conn: Conn, token: str | Callable[[dict[str, Any]], str | None],
                           node_name: str, fingerprints: list[str],
                           extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Challenge the client; returns its auth message (with the fingerprint it wants). `token`
    is the shared secret, or a function from the auth message (e.g. its `user`) to that
    client's own secret (None: unknown client)."""
    nonce = os.urandom(32)
    await conn.send({"type": "hello", "version": PROTOCOL_VERSION, "nonce": nonce,
                     "node": node_name})
    msg = await conn.recv()
    if msg.get("type") != "auth":
        raise AuthError(f"expected auth, got {msg.get('type')!r}")
    if msg.get("version") != PROTOCOL_VERSION:
        raise AuthError(f"protocol version {msg.get('version')!r}, this node speaks {PROTOCOL_VERSION}")
    mac, cnonce = msg.get("mac"), msg.get("nonce")
    if callable(token):
        secret = token(msg)
        if secret is None:
            raise AuthError(f"unknown user {str(msg.get('user'))[:64]!r}")
        token = secret
    if not isinstance(mac, bytes) or not hmac.compare_digest(mac, _mac(token, nonce, b"client")):
        raise AuthError("wrong token")
    if not isinstance(cnonce, bytes) or len(cnonce) != 32:
        raise AuthError("client nonce missing")
    await conn.send({"type": "welcome", "mac": _mac(token, cnonce, b"server"), "node": node_name,
                     "fingerprints": fingerprints, **(extra or {})})
    return msg


async def client_handshake(conn: Conn, token: str, fingerprint: str | None,
                           user: str | None = None) -> dict[str, Any]:
    """Answer the node's challenge and check that the node knows the token too."""
    hello = await conn.recv()
    if hello.get("type") != "hello" or not isinstance(hello.get("nonce"), bytes):
        raise AuthError(f"{conn.peer}: expected hello, got {hello.get('type')!r}")
    if hello.get("version") != PROTOCOL_VERSION:
        raise AuthError(f"{conn.peer}: node speaks protocol {hello.get('version')!r}, "
                        f"this client {PROTOCOL_VERSION}")
    cnonce = os.urandom(32)
    await conn.send({"type": "auth", "version": PROTOCOL_VERSION, "nonce": cnonce,
                     "mac": _mac(token, hello["nonce"], b"client"), "fingerprint": fingerprint,
                     **({"user": user} if user is not None else {})})
    msg = await conn.recv()
    if msg.get("type") == "error":
        raise AuthError(f"{conn.peer}: {msg.get('message')}")
    mac = msg.get("mac")
    if not isinstance(mac, bytes) or not hmac.compare_digest(mac, _mac(token, cnonce, b"server")):
        raise AuthError(f"{conn.peer}: the node failed to prove the cluster token")
    return msg


async def connect(host: str, port: int, token: str, fingerprint: str | None, limits: WireLimits,
                  timeout: float, user: str | None = None) -> tuple[Conn, dict[str, Any]]:
    """Open and authenticate a connection; (conn, the node's welcome)."""
    peer = f"{host}:{port}"
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (TimeoutError, OSError) as exc:
        raise ConnectionError(f"{peer}: cannot connect: {exc or 'timed out'}") from exc
    conn = Conn(reader, writer, limits, peer)
    try:
        welcome = await asyncio.wait_for(client_handshake(conn, token, fingerprint, user), timeout)
    except (TimeoutError, asyncio.IncompleteReadError, ProtocolError, AuthError, OSError):
        await conn.close()
        raise
    return conn, welcome
