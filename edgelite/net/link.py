"""A control connection to a node: requests with ids, one reader task routing every reply.

Used by the client (deploy, load, stats), the prober (profile, link probes) and the nodes
themselves (nothing else): a request gets the reply with its id, a typed message of the kind
asked for; an Error reply raises NodeError, a silent or closed node NodeUnavailable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from edgelite.config import WireLimits
from edgelite.errors import AuthError, EdgeliteError, NodeError, NodeUnavailable, ProtocolError
from edgelite.ids import NodeAddr
from edgelite.net import messages as m
from edgelite.net.frames import Conn
from edgelite.net.handshake import connect
from edgelite.net.schema import Message

log = logging.getLogger(__name__)
R = TypeVar("R", bound=Message)


@dataclass
class NodeLink:
    """One authenticated control connection to a node."""

    addr: NodeAddr
    conn: Conn
    welcome: m.Welcome
    on_lost: Callable[[NodeLink, str], None] = lambda _link, _reason: None
    pending: dict[int, asyncio.Future[Message]] = field(default_factory=dict)
    ids: itertools.count = field(default_factory=itertools.count)
    task: asyncio.Task[None] | None = None
    lost: str | None = None  # why the connection ended (None: still open)

    @property
    def name(self) -> str:
        return str(self.addr)

    @classmethod
    async def open(cls, addr: NodeAddr, token: str, fingerprint: str | None, limits: WireLimits,
                   timeout_s: float, on_lost: Callable[[NodeLink, str], None] | None = None,
                   client: str | None = None, kv: str | None = None,
                   local_host: str | None = None) -> NodeLink:
        """Connect and authenticate (as `client`, see handshake.connect); NodeUnavailable (with
        the reason) when that fails."""
        try:
            conn, welcome = await connect(addr, token, fingerprint, limits, timeout_s,
                                          client=client, kv=kv, local_host=local_host)
        except ConnectionError as exc:
            raise NodeUnavailable(f"node {exc}", node=str(addr)) from exc
        except AuthError as exc:  # (its text names the peer already, as a ConnectionError's)
            raise NodeUnavailable(f"node {exc}", node=str(addr)) from exc
        link = cls(addr, conn, welcome, on_lost or (lambda _link, _reason: None))
        link.task = asyncio.get_running_loop().create_task(link._read(), name=f"link {addr}")
        return link

    async def _read(self) -> None:
        reason = "closed the connection"
        try:
            while True:
                msg = await self.conn.recv()
                rid = getattr(msg, "id", None)
                if (fut := self.pending.pop(rid, None)) is not None and not fut.done():  # type: ignore[arg-type]
                    fut.set_result(msg)
        except asyncio.IncompleteReadError:
            pass
        except (ConnectionError, OSError, EdgeliteError) as exc:
            reason = f"connection broke: {exc}"
        finally:
            self.lost = reason
            err = NodeUnavailable(f"node {self.name} {reason}", node=self.name)
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(err)
            self.pending.clear()
            self.on_lost(self, reason)

    async def request(self, msg: Message, reply: type[R], timeout: float) -> R:
        """Send `msg` with a fresh id and wait for its reply of type `reply`."""
        if self.lost is not None:
            raise NodeUnavailable(f"node {self.name} {self.lost}", node=self.name)
        rid = next(self.ids)
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        try:
            await self.conn.send(dataclasses.replace(msg, id=rid))  # type: ignore[type-var]
            got = await asyncio.wait_for(fut, timeout)
        except TimeoutError as exc:
            raise NodeUnavailable(f"node {self.name} did not answer {msg.TYPE} within "
                                  f"{timeout:g} s", node=self.name) from exc
        except (ConnectionError, OSError) as exc:
            raise NodeUnavailable(f"node {self.name}: {exc}", node=self.name) from exc
        finally:
            self.pending.pop(rid, None)
        if isinstance(got, m.Error):
            raise NodeError(f"node {self.name}: {got.message}", node=self.name)
        if not isinstance(got, reply):
            raise ProtocolError(f"node {self.name} answered {msg.TYPE} with {got.TYPE}")
        return got

    async def close(self) -> None:
        await self.conn.close()
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


async def ask_once(addr: NodeAddr, token: str, msg: Message, reply: type[R], connect_timeout_s: float,
                   request_timeout_s: float, kv: str | None = None) -> R:
    """One request on a connection of its own: opened (as the client whose KV key is `kv`),
    asked, closed."""
    link = await NodeLink.open(addr, token, None, WireLimits(), connect_timeout_s, kv=kv)
    try:
        return await link.request(msg, reply, request_timeout_s)
    finally:
        await link.close()
