"""Finding nodes on the LAN: the client broadcasts a question on UDP, nodes of its cluster answer.

Both directions carry an HMAC-SHA256 under the cluster token over a fresh nonce: a node answers
only questions made with its token (a neighbour's client learns nothing), and the client keeps
only answers made with it (a neighbour's nodes, or a stale answer to an older question, are
ignored). An answer says the node's TCP port and, when it listens on one address only, that
address; otherwise the client reaches it at the address the answer came from. Datagrams are
JSON, bounded in size; anything else is dropped without a reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import socket
from dataclasses import dataclass
from typing import Any, cast

from edgelite.config import DiscoveryConfig
from edgelite.errors import EdgeliteError
from edgelite.ids import NodeAddr

log = logging.getLogger(__name__)
VERSION = 1
MAX_DATAGRAM = 1024  # a question or an answer is far smaller; larger datagrams are dropped
ANY_HOST = ("", "0.0.0.0", "::")


@dataclass(frozen=True)
class Found:
    """A node that answered: where to reach it and the name it gave."""

    addr: NodeAddr
    name: str


def _mac(token: str, kind: str, fields: list[Any]) -> str:
    body = json.dumps([f"edgelite-discover-{kind}", VERSION, *fields], separators=(",", ":"))
    return hmac.new(token.encode(), body.encode(), hashlib.sha256).hexdigest()


def question(token: str, nonce: str) -> bytes:
    return json.dumps({"edgelite": "discover", "v": VERSION, "nonce": nonce,
                       "mac": _mac(token, "q", [nonce])}).encode()


def _parse(data: bytes) -> dict[str, Any] | None:
    if len(data) > MAX_DATAGRAM:
        return None
    try:
        msg = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(msg, dict) or msg.get("v") != VERSION:
        return None
    nonce, mac = msg.get("nonce"), msg.get("mac")
    if not (isinstance(nonce, str) and len(nonce) == 32 and isinstance(mac, str)):
        return None
    return msg


def answer_for(token: str, data: bytes, port: int, host: str | None, name: str) -> bytes | None:
    """The node's answer to a datagram; None when it is not a question made with our token."""
    msg = _parse(data)
    if msg is None or msg.get("edgelite") != "discover":
        return None
    if not hmac.compare_digest(str(msg["mac"]), _mac(token, "q", [msg["nonce"]])):
        return None
    fields = [msg["nonce"], port, host, name[:64]]
    return json.dumps({"edgelite": "here", "v": VERSION, "nonce": msg["nonce"], "port": port,
                       "host": host, "name": name[:64], "mac": _mac(token, "a", fields)}).encode()


def found_in(token: str, nonce: str, data: bytes, source: str) -> Found | None:
    """The node an answer names; None for anything but an answer to our question, made with our
    token."""
    msg = _parse(data)
    if msg is None or msg.get("edgelite") != "here" or msg["nonce"] != nonce:
        return None
    port, host, name = msg.get("port"), msg.get("host"), msg.get("name")
    if (type(port) is not int or not 0 < port < 65536 or not isinstance(name, str)
            or not (host is None or (isinstance(host, str) and len(host) <= 64))):
        return None
    if not hmac.compare_digest(str(msg["mac"]), _mac(token, "a", [nonce, port, host, name])):
        return None
    return Found(NodeAddr(host or source, port), name)


class Responder(asyncio.DatagramProtocol):
    """A node's side: answers questions made with its token, to the address they came from."""

    def __init__(self, token: str, port: int, host: str, name: str) -> None:
        self.token, self.port, self.name = token, port, name
        self.host = None if host in ANY_HOST else host
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)  # uvloop's is not a subclass

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = answer_for(self.token, data, self.port, self.host, self.name)
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


async def respond(token: str, udp_port: int, port: int, host: str,
                  name: str) -> asyncio.DatagramTransport | None:
    """Listen for questions on udp_port (shared with other nodes on this device) and answer with
    the node's TCP `port`; None, with one log line, when udp_port cannot be had."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # every node here hears them
        sock.bind(("", udp_port))
    except OSError as exc:
        sock.close()
        log.warning("discovery is off: cannot listen on UDP port %d: %s", udp_port,
                    exc.strerror or exc)
        return None
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: Responder(token, port, host, name), sock=sock)
    return transport


class _Collector(asyncio.DatagramProtocol):
    def __init__(self, token: str, nonce: str) -> None:
        self.token, self.nonce = token, nonce
        self.found: dict[NodeAddr, Found] = {}
        self.errors: list[str] = []

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if (f := found_in(self.token, self.nonce, data, addr[0])) is not None:
            self.found.setdefault(f.addr, f)

    def error_received(self, exc: Exception) -> None:
        self.errors.append(str(exc))


async def discover(token: str, cfg: DiscoveryConfig | None = None) -> list[Found]:
    """The nodes of this cluster that answer within cfg.wait_s, sorted by address. The question
    goes to every cfg.broadcast address every cfg.resend_s (a lost datagram costs one resend)."""
    cfg = cfg or DiscoveryConfig()
    nonce = secrets.token_hex(16)
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_datagram_endpoint(
        lambda: _Collector(token, nonce), local_addr=("0.0.0.0", 0), allow_broadcast=True)
    ask = question(token, nonce)
    try:
        deadline = loop.time() + cfg.wait_s
        while True:
            for dest in cfg.broadcast:  # a send error reaches the protocol (error_received)
                transport.sendto(ask, (dest, cfg.port))
            if len(proto.errors) >= len(cfg.broadcast) and not proto.found:
                raise EdgeliteError(f"cannot look for nodes: broadcast to "
                                    f"{', '.join(cfg.broadcast)} failed: {proto.errors[-1]}")
            left = deadline - loop.time()
            if left <= 0:
                break
            await asyncio.sleep(min(cfg.resend_s, left))
    finally:
        transport.close()
    found = sorted(proto.found.values(), key=lambda f: (f.addr.host, f.addr.port))
    log.info("discovery: %d nodes answered within %g s", len(found), cfg.wait_s)
    return found


def lan_address() -> str | None:
    """This device's address on its default route (no packet is sent), or None offline."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route is looked up
            return str(s.getsockname()[0])
        except OSError:
            return None
