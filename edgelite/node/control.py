"""One control connection's requests, answered side by side within the node's bounds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from edgelite.config import NodeConfig, WireLimits
from edgelite.errors import EdgeliteError, ProtocolError, StreamError
from edgelite.net import messages as m
from edgelite.net.budget import ByteBudget
from edgelite.net.frames import Conn, unpack
from edgelite.net.schema import Message

log = logging.getLogger(__name__)
Handler = Callable[[Any, str], Awaitable[Message]]  # (request, its client's owner key) -> reply
OpenData = Callable[[Conn, m.OpenData, "str | None"], Awaitable[bool]]


async def try_send(conn: Conn, msg: Message) -> None:
    try:
        await conn.send(msg)
    except (ConnectionError, OSError):
        log.debug("%s: could not send %s", conn.peer, msg.TYPE)


class Control:
    """Serves control connections: `handlers` by request type, `ping` at once as it is read,
    `open_data` for a connection that becomes a data connection. Every connection's frames,
    read and held, count against `frame_budget`."""

    def __init__(self, cfg: NodeConfig, limits: WireLimits, handlers: dict[type[Message], Handler],
                 ping: Handler, open_data: OpenData, frame_budget: ByteBudget) -> None:
        self.cfg, self.limits, self.handlers, self.ping = cfg, limits, handlers, ping
        self.open_data, self.frame_budget = open_data, frame_budget
        self.bad_frames = 0  # requests refused

    async def serve(self, conn: Conn, fingerprint: str | None, owner: str) -> None:
        """Answer requests until the peer closes. Each request runs on its own and is answered
        when done (replies carry the request's id), at most `max_requests_per_connection` at
        once (more wait their turn), so a slow one (a KV write waiting behind a long prefill, a
        model load, a link probe) holds back neither the pings of the client's heartbeat, which
        are answered as they are read, nor its other requests. Past `max_queued_requests` the
        connection is not read until one is done, nor while their frames hold
        `max_queued_request_bytes`. A bad request gets an error reply and the connection stays;
        a broken stream (StreamError) ends it. Requests under way when the peer leaves still
        finish."""
        cfg = self.cfg
        slots = asyncio.Semaphore(cfg.max_requests_per_connection)
        running: dict[asyncio.Task[None], int] = {}  # -> the bytes of its frame
        conn.budget = self.frame_budget  # every connection's frames, read and held, within it
        try:
            while True:
                if running and (len(running) >= cfg.max_queued_requests
                                or sum(running.values()) >= cfg.max_queued_request_bytes):
                    await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                    continue
                # (nothing of the last frame stays referenced here while the next one waits)
                frame: dict[str, Any] = {}
                body, msg = b"", None
                try:
                    try:
                        body = await asyncio.wait_for(conn.recv_body(), cfg.idle_timeout_s)
                    except asyncio.IncompleteReadError:
                        return  # clean close between frames
                    frame = unpack(body)
                    msg = m.parse(frame, self.limits)
                    if isinstance(msg, m.OpenData):
                        if running:
                            raise ProtocolError("data: requests are under way on this connection")
                        if await self.open_data(conn, msg, fingerprint):
                            return  # the connection now belongs to the data plane
                        continue
                    if isinstance(msg, m.Ping):
                        await conn.send(await self.ping(msg, owner))
                        continue
                    handler = self.handlers.get(type(msg))
                    if handler is None:
                        raise ProtocolError(f"{msg.TYPE} is not a request this node serves")
                    task = asyncio.create_task(self._answer(conn, frame, msg, handler, owner, slots),
                                               name=f"{conn.peer} {msg.TYPE}")
                    running[task] = len(body)  # (its bytes are given back when it is done)
                    task.add_done_callback(self._request_done(running))
                    body = b""
                except StreamError:
                    raise
                except EdgeliteError as exc:  # the request was bad; the connection stays usable
                    await self.refused(conn, frame, exc)
                finally:
                    if body:  # a frame answered here (or refused): its bytes are free
                        self.frame_budget.give(len(body))
        finally:
            if running:
                try:
                    await asyncio.wait(running)
                except asyncio.CancelledError:  # the node is stopping
                    for task in running:
                        task.cancel()
                    await asyncio.gather(*running, return_exceptions=True)
                    raise

    def _request_done(self, running: dict[asyncio.Task[None], int]) -> Callable[[asyncio.Task[None]], None]:
        def done(task: asyncio.Task[None]) -> None:
            self.frame_budget.give(running.pop(task))  # its frame is no longer held
        return done

    async def _answer(self, conn: Conn, frame: dict[str, Any], msg: Message, handler: Handler,
                      owner: str, slots: asyncio.Semaphore) -> None:
        """One request's reply, or its error (the connection stays), once it has a slot."""
        try:
            async with slots:
                await try_send(conn, await handler(msg, owner))
        except EdgeliteError as exc:
            await self.refused(conn, frame, exc)
        except (TimeoutError, OSError) as exc:
            await self.refused(conn, frame, EdgeliteError(f"{msg.TYPE} failed: {exc or type(exc).__name__}"))
        except Exception as exc:  # a fault of this node's own: the node and the connection go on
            log.exception("%s: %s failed", conn.peer, msg.TYPE)
            await self.refused(conn, frame, EdgeliteError(f"{msg.TYPE} failed on the node: {exc!r}"[:300]))

    async def refused(self, conn: Conn, frame: dict[str, Any], exc: EdgeliteError) -> None:
        self.bad_frames += 1
        rid = m.reply_id(frame)
        log.info("%s: %s refused: %s", conn.peer, str(frame.get("type"))[:40], exc)
        await try_send(conn, m.Error(message=str(exc), id=rid))
