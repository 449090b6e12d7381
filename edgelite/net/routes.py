"""Advertised addresses: how one node reaches another when that differs from the client's view.

Nodes are named by the address the client uses (`host:port` as given in --nodes). By default a
node reaches a peer at that same address. A route overrides it for one direction, e.g. through a
link emulator or a NAT: `SRC>DST=HOST:PORT[/UDP_PORT]` (the UDP port of the loss probe, when it
differs from the TCP port).
"""

from __future__ import annotations

from dataclasses import dataclass

from edgelite.errors import EdgeliteError


@dataclass(frozen=True)
class Addr:
    host: str
    port: int
    udp_port: int | None = None  # None: ask the node (its handshake says)

    @classmethod
    def parse(cls, text: str) -> Addr:
        hostport, _, udp = text.strip().partition("/")
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit() or (udp and not udp.isdigit()):
            raise EdgeliteError(f"address {text!r} is not HOST:PORT[/UDP_PORT]")
        return cls(host, int(port), int(udp) if udp else None)


Routes = dict[tuple[str, str], Addr]


def parse_routes(entries: list[str] | None) -> Routes:
    routes: Routes = {}
    for entry in entries or []:
        pair, sep, addr = entry.partition("=")
        src, arrow, dst = pair.partition(">")
        if not sep or not arrow or not src.strip() or not dst.strip():
            raise EdgeliteError(f"--route {entry!r} is not SRC>DST=HOST:PORT[/UDP_PORT]")
        routes[src.strip(), dst.strip()] = Addr.parse(addr)
    return routes


def route(routes: Routes, src: str, dst: str, default: tuple[str, int]) -> Addr:
    """The address `src` uses to reach `dst` (the client's address for dst by default)."""
    return routes.get((src, dst)) or Addr(default[0], default[1])
