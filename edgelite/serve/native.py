"""The gateway's native front door: the wire protocol (`edgelite chat --gateway`), beside
`serve/http.py`'s OpenAI door.

Clients authenticate as a user of users.json (HMAC with that user's own token); the user's
tier comes from the file, never from the client. A GenerateRequest becomes an `Ask` for
`Gateway.submit`; the gateway's events (serve/events.py) go out as TokenPiece frames, ending
with Done (or Embedded) or an Error.

Each connection has its own writer task fed through a bounded queue: the scheduling loop never
waits on a client's socket, so a client that stops reading holds up nobody (it is dropped once
its queue is full or a send stalls). A client's requests end when it disconnects, and it may
stop one of its own with `generate_cancel`. A client whose requests keep being refused is cut
off and its user may not connect again for a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from edgelite.config import GatewayConfig, WireLimits
from edgelite.errors import AuthError, EdgeliteError, ProtocolError, StreamError
from edgelite.net import messages as m
from edgelite.net.admission import Admission
from edgelite.net.frames import Conn, bound_port, listen
from edgelite.net.handshake import server_handshake
from edgelite.net.schema import Message
from edgelite.serve.ask import Ask
from edgelite.serve.events import Embedded, Event, Failed, Finished, Token
from edgelite.serve.gateway import Gateway
from edgelite.serve.users import User

log = logging.getLogger(__name__)
LINGER_READ_BYTES = 65536  # a read while lingering (what is read is dropped)


class Client:
    """One connected client: its user, and a bounded queue of frames its writer task sends."""

    def __init__(self, conn: Conn, user: User, cfg: GatewayConfig) -> None:
        self.conn, self.user, self.cfg = conn, user, cfg
        self.peer = conn.peer
        self.queue: asyncio.Queue[Message | None] = asyncio.Queue(cfg.client_queue_frames)
        self.gone = False
        self.refused = 0  # requests refused in a row (a flood is disconnected)
        self.closing = False  # the writer sends what is queued, then the connection ends

    def post(self, event: Event) -> None:
        """The gateway's event for this client, as its wire message (queued, not waited on)."""
        self.queue_frame(wire(event))

    def queue_frame(self, msg: Message) -> None:
        """Queue a frame without waiting; a client this far behind is dropped."""
        if self.gone:
            return
        try:
            self.queue.put_nowait(msg)
        except asyncio.QueueFull:
            log.warning("%s (%s) reads nothing: %d frames queued; dropping the client",
                        self.conn.peer, self.user.name, self.queue.qsize())
            self.drop()

    def drop(self) -> None:
        self.gone = True
        self.conn.writer.close()

    def finish(self, last: Message) -> None:
        """Send `last` after what is queued, then end the connection (the writer's last act)."""
        self.queue_frame(last)
        self.closing = True
        with contextlib.suppress(asyncio.QueueFull):
            self.queue.put_nowait(None)

    async def write(self) -> None:
        """The writer task: send queued frames; a send that stalls drops the client."""
        while not self.gone:
            msg = await self.queue.get()
            if msg is None:
                return
            try:
                await asyncio.wait_for(self.conn.send(msg), self.cfg.client_send_timeout_s)
            except (TimeoutError, ConnectionError, OSError):
                log.info("%s: a send stalled or failed; dropping the client", self.conn.peer)
                self.drop()


def ask_of(msg: m.GenerateRequest) -> Ask:
    """The request a frame carries (a bare prompt is one user message)."""
    if (msg.messages is None) == (msg.prompt is None):
        raise ProtocolError("generate needs messages [{role, content}] or a prompt string, "
                            "not both")
    messages = ([{"role": c.role, "content": c.content,
                  **({"tool_calls": c.tool_calls} if c.tool_calls is not None else {})}
                 for c in msg.messages]
                if msg.messages is not None else [{"role": "user", "content": str(msg.prompt)}])
    return Ask(messages=messages, max_tokens=msg.max_tokens, temperature=msg.temperature,
               top_p=msg.top_p, seed=msg.seed, stop=tuple(msg.stop or ()),
               speculate=msg.speculate, top_k=msg.top_k, min_p=msg.min_p,
               presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
               repetition_penalty=msg.repetition_penalty, logprobs=msg.logprobs,
               response_format=msg.response_format, json_schema=msg.json_schema,
               tools=msg.tools, tool_choice=msg.tool_choice)


class NativeDoor:
    """The wire protocol's listener in front of `gateway`."""

    def __init__(self, gateway: Gateway, users: dict[str, User], cfg: GatewayConfig,
                 limits: WireLimits | None = None) -> None:
        self.gateway, self.users, self.cfg = gateway, users, cfg
        self.limits = limits or WireLimits()
        self.server: asyncio.Server | None = None
        self.cooldown: dict[str, float] = {}  # user -> when it may connect again (after a flood)
        self.floods = 0
        self.admission = Admission.of(cfg)

    @property
    def port(self) -> int:
        return bound_port(self.server)

    async def start(self) -> None:
        self.server = await listen(self._handle, self.cfg.host, self.cfg.port)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = writer.get_extra_info("peername")[:2]
        peer = f"{host}:{port}"
        conn = Conn(reader, writer, self.limits, peer)
        refused = self.admission.arrive(host)
        if refused is not None:  # (before anything is read: a flood costs little)
            log.log(logging.DEBUG if refused.budget == "strangers" else logging.WARNING,
                    "%s: refused: %s", peer, refused.why)
            await conn.close()
            return
        client: Client | None = None
        authed = False
        try:
            auth = await asyncio.wait_for(
                server_handshake(conn, self._secret, "edgelite-gateway",
                                 [self.gateway.backend.manifest.fingerprint]),
                self.cfg.handshake_timeout_s)
            self.admission.authenticated(host)
            authed = True
            client = Client(conn, self.users[str(auth.user)], self.cfg)
            writing = asyncio.get_running_loop().create_task(client.write(), name=f"to {peer}")
            try:
                await self._read(client)
                if client.closing:  # its last frames go out first (bounded by the send timeout)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(writing), self.cfg.client_send_timeout_s)
                    await self._linger(conn)
            finally:
                writing.cancel()
                await asyncio.gather(writing, return_exceptions=True)
        except (AuthError, ProtocolError) as exc:
            log.warning("%s: %s; closing", peer, exc)
            with contextlib.suppress(ConnectionError, OSError):
                await conn.send(m.Error(message=str(exc)))
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            log.debug("%s: connection ended: %r", peer, exc)
        finally:
            self.admission.leave(host, authed)
            if client is not None:
                client.gone = True  # the scheduling loop cancels its requests
                self.gateway.wake.set()
            await conn.close()

    async def _linger(self, conn: Conn) -> None:
        """End this side (the client reads to the last frame, then the end), and read and drop
        what the client still sends until it closes, for at most `close_linger_s`: a socket
        closed with bytes unread resets the connection, and a client could then lose the
        frames it had not read yet (a flood's refusals, and why it was cut off)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self.cfg.close_linger_s
        with contextlib.suppress(TimeoutError, ConnectionError, OSError):
            if conn.writer.can_write_eof():
                conn.writer.write_eof()
            while (left := until - loop.time()) > 0:
                if not await asyncio.wait_for(conn.reader.read(LINGER_READ_BYTES), left):
                    return  # (the client closed)

    async def _read(self, client: Client) -> None:
        while not client.gone:
            frame: dict[str, Any] = {}
            try:
                try:
                    frame = await asyncio.wait_for(client.conn.recv_frame(), self.cfg.idle_timeout_s)
                except asyncio.IncompleteReadError:
                    return
                msg = m.parse(frame, self.limits)
                if isinstance(msg, m.GatewayStatsRequest):
                    client.queue_frame(m.GatewayStats(id=msg.id, stats={**self.gateway.stats(),
                                                                 "floods": self.floods,
                                                                 "refused": dict(self.admission.refused)}))
                elif isinstance(msg, m.GenerateRequest):
                    await self.gateway.submit(client, msg.id, ask_of(msg))
                elif isinstance(msg, m.GenerateCancel):
                    self.gateway.cancel(client, msg.id)
                else:
                    raise ProtocolError(f"{msg.TYPE} is not a gateway request")
            except StreamError:
                raise  # the stream cannot be followed: the client goes
            except EdgeliteError as exc:  # a bad request: refused, the connection stays
                client.queue_frame(m.Error(message=str(exc), id=m.reply_id(frame)))
                client.refused += 1
                if client.refused > self.cfg.max_refused_in_a_row:
                    self._flooded(client)
                    return
            else:
                client.refused = 0

    def _flooded(self, client: Client) -> None:
        """A client whose requests keep being refused is cut off, and its user may not connect
        again for `flood_cooldown_s` (a flood costs one handshake per cooldown, no more)."""
        name = client.user.name
        self.cooldown[name] = time.monotonic() + self.cfg.flood_cooldown_s
        self.floods += 1
        log.warning("%s (%s): %d requests refused in a row; disconnected, the user may "
                    "reconnect in %g s", client.conn.peer, name, client.refused,
                    self.cfg.flood_cooldown_s)
        client.finish(m.Error(message=f"{client.refused} requests refused in a row; disconnected "
                                      f"for {self.cfg.flood_cooldown_s:g} s"))

    def _secret(self, auth: m.Auth) -> str | None:
        """The user's token (None: unknown user); a user cooling down after a flood is refused
        before the handshake completes."""
        user = self.users.get(auth.user) if auth.user is not None else None
        if user is None:
            return None
        wait = self.cooldown.get(user.name, 0.0) - time.monotonic()
        if wait > 0:
            raise AuthError(f"user {user.name} sent a flood of refused requests; it may connect "
                            f"again in {wait:.1f} s")
        return user.token


def wire(event: Event) -> Message:
    """A gateway event as the native protocol's message."""
    match event:
        case Token(rid, piece):
            assert piece.token_id is not None
            return m.TokenPiece(id=rid, text=piece.text, token_id=piece.token_id,
                                logprob=piece.logprob, top_ids=[t for t, _ in piece.top],
                                top_logprobs=[lp for _, lp in piece.top])
        case Finished():
            return m.Done(id=event.rid, token_ids=event.token_ids, tier=event.tier,
                          finish=event.finish, ttft_ms=event.ttft_ms, preemptions=event.preemptions,
                          decode_tok_s=event.decode_tok_s, text=event.text,
                          prompt_tokens=event.prompt_tokens, tool_call=event.tool_call)
        case Embedded(rid, vector, prompt_tokens, tier):
            return m.Embedded(id=rid, vector=vector, prompt_tokens=prompt_tokens, tier=tier)
        case Failed(rid, message):
            return m.Error(message=message, id=rid)
    raise TypeError(f"not a gateway event: {event!r}")
