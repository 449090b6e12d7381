"""Talk to an `edgelite serve` gateway: stream a reply, read its stats, or chat."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

from edgelite.config import ClientConfig, WireLimits
from edgelite.errors import NodeError
from edgelite.net import wire


class GatewayClient:
    """One authenticated connection to a gateway; requests on it run one at a time."""

    def __init__(self, conn: wire.Conn) -> None:
        self.conn = conn
        self.ids = itertools.count()
        self.last: dict[str, Any] = {}  # the last reply's `done` figures

    @classmethod
    async def connect(cls, host: str, port: int, user: str, token: str,
                      cfg: ClientConfig | None = None) -> GatewayClient:
        cfg = cfg or ClientConfig()
        conn, _ = await wire.connect(host, port, token, None, WireLimits(), cfg.connect_timeout_s,
                                     user=user)
        return cls(conn)

    async def generate(self, messages: list[dict[str, str]], max_tokens: int = 128,
                       temperature: float = 0.0) -> AsyncIterator[str]:
        """Yield the reply's text pieces; afterwards `last` holds the gateway's figures."""
        rid = next(self.ids)
        await self.conn.send({"type": "generate", "id": rid, "messages": messages,
                              "max_tokens": max_tokens, "temperature": temperature})
        while True:
            msg = await self.conn.recv()
            if msg.get("id") != rid:
                continue
            if msg["type"] == "token":
                yield msg["text"]
            elif msg["type"] == "done":
                self.last = msg
                return
            else:
                raise NodeError(f"gateway: {msg.get('message', msg['type'])}")

    async def stats(self) -> dict[str, Any]:
        rid = next(self.ids)
        await self.conn.send({"type": "stats", "id": rid})
        while (msg := await self.conn.recv()).get("id") != rid:
            pass
        if msg["type"] == "error":
            raise NodeError(f"gateway: {msg.get('message')}")
        return {k: v for k, v in msg.items() if k not in ("type", "id")}

    async def close(self) -> None:
        await self.conn.close()
