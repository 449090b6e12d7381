"""Advertised addresses: how one node reaches another when that differs from the client's view.

Nodes are named by the address the client uses (as given in --nodes). By default a node reaches
a peer at that same address. A route overrides it for one direction, e.g. through a link
emulator or a NAT: `SRC>DST=HOST:PORT[/UDP_PORT]` (the UDP port of the loss probe, when it
differs from the TCP port).
"""

from __future__ import annotations

from edgelite.errors import EdgeliteError
from edgelite.ids import NodeAddr

Routes = dict[tuple[NodeAddr, NodeAddr], NodeAddr]


def parse_routes(entries: list[str] | None) -> Routes:
    routes: Routes = {}
    for entry in entries or []:
        pair, sep, addr = entry.partition("=")
        src, arrow, dst = pair.partition(">")
        if not sep or not arrow or not src.strip() or not dst.strip():
            raise EdgeliteError(f"--route {entry!r} is not SRC>DST=HOST:PORT[/UDP_PORT]")
        routes[NodeAddr.parse(src), NodeAddr.parse(dst)] = NodeAddr.parse(addr)
    return routes


def route(routes: Routes, src: NodeAddr, dst: NodeAddr) -> NodeAddr:
    """The address `src` uses to reach `dst` (the client's address for dst by default)."""
    return routes.get((src, dst), dst)
