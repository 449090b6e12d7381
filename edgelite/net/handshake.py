"""The connection handshake: mutual HMAC-SHA256 challenge-response over a shared secret.

The server says Hello (a nonce); the client answers Auth (its MAC over that nonce, its own
nonce, the model fingerprint it wants); the server checks it and proves it knows the secret too
(Welcome). Only then are large frames read (frames.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from collections.abc import Callable
from typing import Any

from edgelite.config import WireLimits
from edgelite.errors import AuthError, ProtocolError
from edgelite.ids import NodeAddr
from edgelite.net import messages as m
from edgelite.net.frames import Conn

PROTOCOL_VERSION = 2
MIN_CLIENT_KEY = 32  # characters of Auth.client (128 bits in hex): not guessable
Secret = str | Callable[[m.Auth], str | None]


def _mac(token: str, nonce: bytes, role: bytes) -> bytes:
    return hmac.new(token.encode(), role + nonce, hashlib.sha256).digest()


async def server_handshake(conn: Conn, token: Secret, node_name: str, fingerprints: list[str],
                           port: int | None = None, udp_port: int | None = None) -> m.Auth:
    """Challenge the client; returns its Auth (with the fingerprint it wants). `token` is the
    shared secret, or a function from the Auth (e.g. its `user`) to that client's own secret
    (None: unknown client)."""
    nonce = os.urandom(32)
    await conn.send(m.Hello(version=PROTOCOL_VERSION, nonce=nonce, node=node_name))
    try:
        auth = await conn.recv()
    except ProtocolError as exc:
        raise AuthError(f"bad handshake: {exc}") from exc
    if not isinstance(auth, m.Auth):
        raise AuthError(f"expected auth, got {auth.TYPE}")
    if auth.version != PROTOCOL_VERSION:
        raise AuthError(f"protocol version {auth.version}, this end speaks {PROTOCOL_VERSION}")
    secret = token(auth) if callable(token) else token
    if secret is None:
        raise AuthError(f"unknown user {str(auth.user)[:64]!r}")
    if not hmac.compare_digest(auth.mac, _mac(secret, nonce, b"client")):
        raise AuthError("wrong token")
    if len(auth.nonce) != 32:
        raise AuthError("client nonce missing")
    if auth.client is not None and len(auth.client) < MIN_CLIENT_KEY:
        raise AuthError(f"auth.client: a client key has at least {MIN_CLIENT_KEY} characters")
    if auth.kv is not None and len(auth.kv) < MIN_CLIENT_KEY:
        raise AuthError(f"auth.kv: a KV key has at least {MIN_CLIENT_KEY} characters")
    conn.authenticated = True
    await conn.send(m.Welcome(mac=_mac(secret, auth.nonce, b"server"), node=node_name,
                              fingerprints=fingerprints, port=port, udp_port=udp_port))
    return auth


async def client_handshake(conn: Conn, token: str, fingerprint: str | None,
                           user: str | None = None, client: str | None = None,
                           kv: str | None = None) -> m.Welcome:
    """Answer the server's challenge and check that it knows the secret too."""
    hello = await conn.recv()
    if not isinstance(hello, m.Hello):
        raise AuthError(f"{conn.peer}: expected hello, got {hello.TYPE}")
    if hello.version != PROTOCOL_VERSION:
        raise AuthError(f"{conn.peer}: the peer speaks protocol {hello.version}, "
                        f"this client {PROTOCOL_VERSION}")
    cnonce = os.urandom(32)
    await conn.send(m.Auth(version=PROTOCOL_VERSION, nonce=cnonce,
                           mac=_mac(token, hello.nonce, b"client"), fingerprint=fingerprint, user=user,
                           client=client, kv=kv))
    welcome = await conn.recv()
    if isinstance(welcome, m.Error):
        raise AuthError(f"{conn.peer}: {welcome.message}")
    if not isinstance(welcome, m.Welcome):
        raise AuthError(f"{conn.peer}: expected welcome, got {welcome.TYPE}")
    if not hmac.compare_digest(welcome.mac, _mac(token, cnonce, b"server")):
        raise AuthError(f"{conn.peer}: the peer failed to prove the shared token")
    conn.authenticated = True
    return welcome


def describe_os_error(exc: BaseException) -> str:
    """A connect failure in words: refused, timed out, no route, unknown host."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens on that port: is it running there?)"
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{exc.strerror or exc}".lower()
    return str(exc) or type(exc).__name__


async def connect(addr: NodeAddr, token: str, fingerprint: str | None, limits: WireLimits,
                  timeout: float, user: str | None = None,
                  client: str | None = None, kv: str | None = None,
                  local_host: str | None = None) -> tuple[Conn, m.Welcome]:
    """Open and authenticate a connection: (conn, the peer's welcome). ConnectionError (with
    the reason in words) when it cannot be reached; AuthError when the handshake fails.
    `client`: this client's key (Auth.client), so that the node counts this connection as
    one of the plans' owner's; `local_host`: the address to connect from (None: the system's
    choice)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(
            addr.host, addr.port, local_addr=None if local_host is None else (local_host, 0)),
                                                timeout)
    except (TimeoutError, OSError) as exc:
        reason = describe_os_error(exc)
        if isinstance(exc, TimeoutError):
            reason = f"no answer within {timeout:g} s"
        raise ConnectionError(f"{addr}: cannot connect: {reason}") from exc
    conn = Conn(reader, writer, limits, str(addr))
    try:
        welcome = await asyncio.wait_for(client_handshake(conn, token, fingerprint, user, client, kv),
                                         timeout)
    except TimeoutError as exc:
        await conn.close()
        raise ConnectionError(f"{addr}: no handshake within {timeout:g} s") from exc
    except (asyncio.IncompleteReadError, ProtocolError, OSError) as exc:
        await conn.close()
        raise ConnectionError(f"{addr}: handshake failed: {exc!r}") from exc
    except BaseException:
        await conn.close()
        raise
    return conn, welcome


def peer_info(welcome: m.Welcome) -> dict[str, Any]:
    return {"node": welcome.node, "port": welcome.port, "udp_port": welcome.udp_port}
