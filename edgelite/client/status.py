"""What runs where: each node's plans, sessions and memory as it reports them (`edgelite ps`).

Asked as this device's client (its kept KV key): a node shows the plans and sessions of that
client in full and other clients' only as counts."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from edgelite import paths
from edgelite.config import ClientConfig
from edgelite.errors import EdgeliteError
from edgelite.ids import NodeAddr
from edgelite.net import messages as m
from edgelite.net.link import ask_once


async def status(addrs: Sequence[NodeAddr], token: str,
                 cfg: ClientConfig | None = None) -> list[dict[str, Any]]:
    """Each node's stats by its address (`addr`; `node`: the name it gives itself; `reachable`
    true), or why it could not be asked (`reachable` false, `error`)."""
    return await _ask_all(addrs, token, cfg or ClientConfig())


async def _ask_all(addrs: Sequence[NodeAddr], token: str, cfg: ClientConfig) -> list[dict[str, Any]]:
    async def one(addr: NodeAddr) -> dict[str, Any]:
        try:
            reply = await ask_once(addr, token, m.StatsRequest(id=0), m.StatsReply, cfg.connect_timeout_s,
                                   cfg.request_timeout_s, kv=paths.kv_key())
        except EdgeliteError as exc:
            return {"addr": str(addr), "reachable": False, "error": str(exc)}
        return {"addr": str(addr), "reachable": True, **reply.stats}

    return list(await asyncio.gather(*(one(a) for a in addrs)))
