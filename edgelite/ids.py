"""Typed identities: a node's address, a plan id, a session id (one name each, used everywhere)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import NewType

from edgelite.errors import EdgeliteError

PlanId = NewType("PlanId", str)
SessionId = NewType("SessionId", str)
ID_BYTES = 16  # 128 bits: ids that cannot be guessed (they are capabilities on the wire)


def new_plan_id() -> PlanId:
    return PlanId(secrets.token_hex(ID_BYTES))


def new_session_id() -> SessionId:
    return SessionId(secrets.token_hex(ID_BYTES))


@dataclass(frozen=True, order=True)
class NodeAddr:
    """Where a node listens: its identity in plans, probes and stats ("host:port").
    `udp_port` is the loss probe's port when it differs from `port` (routes through a NAT or a
    link emulator); it is not part of the identity."""

    host: str
    port: int
    udp_port: int | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> NodeAddr:
        """HOST:PORT[/UDP_PORT]; a one-line error naming the text otherwise."""
        hostport, _, udp = text.strip().partition("/")
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit() or (udp and not udp.isdigit()):
            raise EdgeliteError(f"address {text!r} is not HOST:PORT[/UDP_PORT]")
        addr = cls(host.strip("[]"), int(port), int(udp) if udp else None)
        for p in (addr.port, addr.udp_port):
            if p is not None and not 0 < p < 65536:
                raise EdgeliteError(f"address {text!r}: port {p} is outside 1-65535")
        return addr


def parse_nodes(text: str) -> list[NodeAddr]:
    """A comma-separated list of HOST:PORT (as `--nodes` takes it)."""
    addrs = [NodeAddr.parse(part) for part in text.split(",") if part.strip()]
    if not addrs:
        raise EdgeliteError("no node address given (expected HOST:PORT,...)")
    if len(set(addrs)) != len(addrs):
        raise EdgeliteError(f"a node is listed twice in {text!r}")
    return addrs
