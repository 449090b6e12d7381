"""One admission policy for every listener: a node (node/server.py), the gateway's native door
(serve/native.py) and its HTTP door (serve/http.py).

A connection is refused as it arrives, before anything of it is read, when the listener has
`total` connections open, or its address `per_address`; and, until it authenticates, when
`strangers` connections are unauthenticated, or `strangers_per_address` from its address.
Strangers have a budget of their own, so a flood of them (each for at most the listener's
handshake timeout) cannot keep clients out; one address cannot take the whole of either. A
listener whose connections authenticate per request (HTTP) never calls `authenticated`: its
strangers' budget is its whole budget. Pure bookkeeping, on the event loop's thread.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Refusal:
    """Why a connection was refused: `budget` "strangers" (not yet authenticated) or
    "connections" (all open), and a line that says it."""

    budget: str
    why: str


@dataclass(frozen=True)
class AdmissionLimits:
    total: int  # connections open at once
    per_address: int  # of them from one address
    strangers: int  # of them not yet authenticated
    strangers_per_address: int  # of those from one address


class Bounded(Protocol):
    """A listener's configuration (NodeConfig, GatewayConfig): its four admission limits."""

    max_connections: int
    max_connections_per_address: int
    max_unauthenticated: int
    max_unauthenticated_per_address: int


class Admission:
    @classmethod
    def of(cls, cfg: Bounded) -> Admission:
        """The policy with a listener's configured limits."""
        return cls(AdmissionLimits(cfg.max_connections, cfg.max_connections_per_address,
                                   cfg.max_unauthenticated, cfg.max_unauthenticated_per_address))

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.open: Counter[str] = Counter()  # address -> its connections
        self.unknown: Counter[str] = Counter()  # address -> those not yet authenticated
        self.refused: Counter[str] = Counter()  # why -> how many were refused so

    def arrive(self, address: str) -> Refusal | None:
        """Count a new connection from `address` (None), or say why it is refused (it is then
        not counted)."""
        lim, opened, strangers = self.limits, self.connections, self.strangers
        if strangers >= lim.strangers or self.unknown[address] >= lim.strangers_per_address:
            refusal = Refusal("strangers", f"{strangers} connections not yet authenticated, "
                              f"{self.unknown[address]} of them from {address} (the limits: "
                              f"{lim.strangers}, {lim.strangers_per_address})")
        elif opened >= lim.total or self.open[address] >= lim.per_address:
            refusal = Refusal("connections", f"{opened} connections open, {self.open[address]} of them "
                              f"from {address} (the limits: {lim.total}, {lim.per_address})")
        else:
            self.open[address] += 1
            self.unknown[address] += 1
            return None
        self.refused[refusal.budget] += 1
        return refusal

    def authenticated(self, address: str) -> None:
        """A counted connection from `address` passed its handshake."""
        _take(self.unknown, address)

    def leave(self, address: str, authenticated: bool) -> None:
        """A counted connection from `address` closed."""
        _take(self.open, address)
        if not authenticated:
            _take(self.unknown, address)

    @property
    def strangers(self) -> int:
        return sum(self.unknown.values())

    @property
    def connections(self) -> int:
        return sum(self.open.values())


def _take(counts: Counter[str], address: str) -> None:
    counts[address] -= 1
    if counts[address] <= 0:
        del counts[address]
