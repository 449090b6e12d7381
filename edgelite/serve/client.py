"""Talk to an `edgelite serve` gateway: stream a reply, read its stats."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

from edgelite.config import ClientConfig, GenerationConfig, WireLimits
from edgelite.errors import AuthError, NodeError, NodeUnavailable
from edgelite.ids import NodeAddr
from edgelite.net import messages as m
from edgelite.net.frames import Conn
from edgelite.net.handshake import connect


class GatewayClient:
    """One authenticated connection to a gateway; requests on it run one at a time."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self.ids = itertools.count()
        self.last: m.Done | None = None  # the last reply's figures

    @classmethod
    async def connect(cls, addr: NodeAddr, user: str, token: str,
                      cfg: ClientConfig | None = None) -> GatewayClient:
        cfg = cfg or ClientConfig()
        try:
            conn, _ = await connect(addr, token, None, WireLimits(), cfg.connect_timeout_s, user=user)
        except (ConnectionError, AuthError) as exc:
            raise NodeUnavailable(f"gateway {exc}", node=str(addr)) from exc
        return cls(conn)

    async def generate(self, messages: list[dict[str, str]],
                       cfg: GenerationConfig | None = None) -> AsyncIterator[str]:
        """Yield the reply's text pieces; afterwards `last` holds the gateway's figures (and
        a tool call: `last.tool_call`)."""
        cfg = cfg or GenerationConfig()
        rid = next(self.ids)
        await self.conn.send(m.GenerateRequest(
            id=rid, messages=[m.ChatMessage(role=x["role"], content=x["content"],  # type: ignore[arg-type]
                                            tool_calls=x.get("tool_calls")) for x in messages],
            max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
            stop=list(cfg.stop) or None, speculate=cfg.speculate,
            response_format=None if cfg.response_format == "text" else cfg.response_format,
            json_schema=cfg.json_schema or None, tools=cfg.tools or None,
            tool_choice=cfg.tool_choice if cfg.tools else None))
        done = False
        try:
            while True:
                msg = await self.conn.recv()
                if getattr(msg, "id", None) != rid:
                    continue
                if isinstance(msg, m.TokenPiece):
                    yield msg.text
                elif isinstance(msg, m.Done):
                    self.last, done = msg, True
                    if msg.text:  # held back until the end
                        yield msg.text
                    return
                else:
                    done = True
                    raise NodeError(f"gateway: {getattr(msg, 'message', msg.TYPE)}")
        finally:
            if not done:  # the caller stopped (Ctrl-C): the gateway stops too
                with contextlib.suppress(ConnectionError, OSError, asyncio.CancelledError):
                    await asyncio.shield(self.conn.send(m.GenerateCancel(id=rid)))

    async def stats(self) -> dict[str, Any]:
        rid = next(self.ids)
        await self.conn.send(m.GatewayStatsRequest(id=rid))
        while True:
            msg = await self.conn.recv()
            if getattr(msg, "id", None) == rid:
                break
        if isinstance(msg, m.Error):
            raise NodeError(f"gateway: {msg.message}")
        if not isinstance(msg, m.GatewayStats):
            raise NodeError(f"gateway answered stats with {msg.TYPE}")
        return msg.stats

    async def close(self) -> None:
        await self.conn.close()
