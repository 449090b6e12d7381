"""The OpenAI-compatible HTTP API (`edgelite serve --http HOST:PORT`), over the same gateway,
scheduler and tiers as the native protocol.

POST /v1/chat/completions and /v1/completions (`stream` true: server-sent events ending with
`data: [DONE]`; chat's `tools` give `tool_calls`, reply/tools.py), POST /v1/embeddings (each
input's vector, reply/embed.py, through the same gateway), GET /v1/models, /health (503 until
the plan is deployed, and while a lost node is being replaced), /metrics (Prometheus text), /
(the cluster's web page, serve/page.py) and /v1/cluster (what that page shows). A field this
server does not take is a 400 naming it, never ignored. `Authorization: Bearer <token>` names a
user of users.json (its tier comes from the file); without users every request is "anonymous".
Errors are OpenAI's error JSON. A client that disconnects cancels its request.

The HTTP layer is Starlette on uvicorn with its pure-Python h11 protocol: both are small,
maintained, pure-Python wheels (they install in Termux without a compiler), and an optional
extra (`pip install edgelite[http]`). Imported only when `--http` is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from edgelite.config import HttpConfig
from edgelite.errors import ProtocolError, QueueFull
from edgelite.net.admission import Admission, AdmissionLimits
from edgelite.net.frames import listen_error
from edgelite.serve.ask import Ask, AskError
from edgelite.serve.events import Embedded, Event, Failed, Finished, Token
from edgelite.serve.gateway import Gateway
from edgelite.serve.metrics import prometheus
from edgelite.serve.openai import (
    KEEP_ALIVE,
    ApiError,
    Call,
    Chunks,
    completion,
    embeddings,
    error_event,
    logprob_block,
    parse_call,
    parse_embedding,
)
from edgelite.serve.page import page_html
from edgelite.serve.users import ANONYMOUS, User

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: Ctrl-C belongs to the command that runs us."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _protocol(cfg: HttpConfig) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the bounds it lacks: net/admission.py's policy, as every
    listener has it (at most `max_connections` open, `max_connections_per_address` from one
    address; more are closed as they come, one stranger cannot fill the server: a request
    authenticates by its own header, so every connection counts as a stranger), and a request's
    headers must be in within `header_timeout_s` of the connection (or of the previous reply):
    a client that opens connections and sends nothing, or its headers a byte at a time, holds
    nothing for long."""

    admission = Admission(AdmissionLimits(cfg.max_connections, cfg.max_connections_per_address,
                                          cfg.max_connections, cfg.max_connections_per_address))

    class Bounded(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._deadline: asyncio.TimerHandle | None = None
            host = self.client[0] if self.client else "?"
            refused = admission.arrive(host)
            if refused is not None:
                log.info("HTTP connection from %s closed: %s", self.client, refused.why)
                self._host: str | None = None
                transport.close()
                return
            self._host = host
            self._arm()

        def _arm(self) -> None:
            self._waiting_for = self.cycle  # headers of a request after this one are due
            self._deadline = self.loop.call_later(cfg.header_timeout_s, self._late)

        def _late(self) -> None:
            if not self.transport.is_closing():
                log.info("HTTP connection from %s closed: no request headers within %g s",
                         self.client, cfg.header_timeout_s)
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self._deadline is not None and self.cycle is not self._waiting_for:
                self._deadline.cancel()  # a request's headers are in
                self._deadline = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self._deadline is None:
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if getattr(self, "_deadline", None) is not None:
                self._deadline.cancel()  # type: ignore[union-attr]
            host = getattr(self, "_host", None)
            if host is not None:
                admission.leave(host, authenticated=False)
            super().connection_lost(exc)

    return Bounded


@dataclass(eq=False)
class HttpSink:
    """One HTTP request as the gateway sees a client: the events it posts land in `queue`."""

    user: User
    peer: str
    gone: bool = False
    done: bool = False  # its reply ended (a client that leaves after that did not cut it short)
    queue: asyncio.Queue[Event | None] = field(default_factory=asyncio.Queue)

    def post(self, event: Event) -> None:
        if not self.gone:
            self.queue.put_nowait(event)  # unbounded: a request posts at most max_tokens + 1


class HttpApi:
    """The Starlette app. `gateway` is None until the plan is deployed (/health says 503)."""

    def __init__(self, model_id: str, users: dict[str, User] | None, cfg: HttpConfig) -> None:
        self.model_id, self.cfg = model_id, cfg
        self.by_token = {u.token: u for u in users.values()} if users else None
        self.gateway: Gateway | None = None
        # what /v1/cluster shows (serve/page.py), set with the gateway
        self.cluster: Callable[[], Awaitable[dict[str, Any]]] | None = None
        self.requests_total = 0
        self.disconnects = 0  # requests whose client went away before the end
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/embeddings", self.embed, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/", self.page, methods=["GET"]),
            Route("/v1/cluster", self.cluster_figures, methods=["GET"]),
        ], exception_handlers={404: self._not_found, 405: self._not_allowed})

    # ---- serving -------------------------------------------------------------------------
    def bind(self) -> socket.socket:
        """The listening socket (port 0: any free port; `.getsockname()` tells)."""
        try:
            sock = socket.create_server((self.cfg.host, self.cfg.port), reuse_port=False)
        except OSError as exc:
            raise listen_error(self.cfg.host, self.cfg.port, exc, "--http") from None
        sock.setblocking(False)
        return sock

    async def serve(self, sock: socket.socket) -> None:
        config = uvicorn.Config(self.app, http=_protocol(self.cfg), lifespan="off", log_config=None,
                                access_log=False, timeout_keep_alive=self.cfg.keep_alive_s)
        await _Server(config).serve(sockets=[sock])

    # ---- endpoints -----------------------------------------------------------------------
    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return ApiError(404, f"no route {request.method} {request.url.path}", code="not_found").response()

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}").response()

    async def models(self, request: Request) -> Response:
        try:
            self._user(request)
        except ApiError as exc:
            return exc.response()
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": 0, "owned_by": "edgelite"}]})

    async def health(self, request: Request) -> Response:
        """Whether the server can answer; where the layers run only to a user (a stranger learns
        nothing of the nodes)."""
        gw = self.gateway
        try:
            self._user(request)
        except ApiError:
            ready = gw is not None and gw.ready
            return JSONResponse({"status": "ok" if ready else "unavailable"},
                                status_code=200 if ready else 503)
        if gw is None:
            return JSONResponse({"status": "starting", "detail": "the cluster is being planned "
                                 "and deployed"}, status_code=503)
        if not gw.ready:
            return JSONResponse({"status": "unavailable", "detail": gw.down or "a node was lost; the "
                                 "plan is being deployed again"}, status_code=503)
        plan = getattr(gw.backend, "plan", None)  # (where the layers run now, after failovers)
        stages = [{"device": st.device, "layers": [st.first, st.last],
                   "addr": None if st.addr is None else str(st.addr)}
                  for st in (plan.stages if plan is not None else ())]
        return JSONResponse({"status": "ok", "model": self.model_id, "plan": stages})

    async def page(self, request: Request) -> Response:
        """The web page (its figures and chat come from the routes above, with the user's token)."""
        return Response(page_html(), media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache"})

    async def cluster_figures(self, request: Request) -> Response:
        try:
            self._user(request)
            if self.cluster is None:
                raise ApiError(503, "the cluster is being planned and deployed", "server_error",
                               code="starting")
        except ApiError as exc:
            return exc.response()
        return JSONResponse(await self.cluster())

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(prometheus(self.gateway, self.requests_total, self.disconnects),
                                 media_type="text/plain; version=0.0.4")

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool) -> Response:
        try:
            user = self._user(request)
            body = await read_body(request, self.cfg)
            gw = self._gateway()
            call = parse_call(body, chat, self.model_id)
            sink = HttpSink(user, _peer(request))
            rid = secrets.randbits(48)
            try:
                await gw.submit(sink, rid, call.ask)
            except QueueFull as exc:
                raise ApiError(429, str(exc), "rate_limit_error", code="queue_full") from exc
            except AskError as exc:
                raise ApiError(400, str(exc), param=exc.param) from exc
            except ProtocolError as exc:
                raise ApiError(400, str(exc)) from exc
        except ApiError as exc:
            return exc.response()
        self.requests_total += 1
        name = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        if call.stream:
            return StreamingResponse(self._events(request, sink, call, name),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._whole(request, sink, call, name)

    async def embed(self, request: Request) -> Response:
        """Each input's embedding, one after another through the gateway's queue."""
        try:
            user = self._user(request)
            texts, as_base64 = parse_embedding(await read_body(request, self.cfg), self.model_id,
                                               self.cfg.max_embedding_inputs)
            gw = self._gateway()
            got_all: list[Embedded] = []
            for i, text in enumerate(texts):
                sink = HttpSink(user, _peer(request))
                try:
                    await gw.submit(sink, secrets.randbits(48), Ask(text=text, embedding=True))
                except QueueFull as exc:
                    raise ApiError(429, str(exc), "rate_limit_error", code="queue_full") from exc
                except (AskError, ProtocolError) as exc:
                    raise ApiError(400, f"input[{i}]: {exc}", param="input") from exc
                got = await self._embedded(request, sink)
                if got is None:
                    return Response(status_code=499)  # the client left: nobody reads this
                got_all.append(got)
        except ApiError as exc:
            return exc.response()
        self.requests_total += 1
        return JSONResponse(embeddings(got_all, self.model_id, as_base64))

    async def _embedded(self, request: Request, sink: HttpSink) -> Embedded | None:
        """The gateway's answer to an embedding (None: the client left, which cancels it)."""
        watcher = asyncio.get_running_loop().create_task(self._watch(request, sink))
        try:
            msg = await sink.queue.get()
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        if isinstance(msg, Failed):
            raise ApiError(500, msg.message, "server_error")
        if not isinstance(msg, Embedded):
            return None
        sink.done = True
        return msg

    # ---- requests ------------------------------------------------------------------------
    def _user(self, request: Request) -> User:
        if self.by_token is None:
            return ANONYMOUS
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "missing 'Authorization: Bearer <token>'", "authentication_error",
                           code="invalid_api_key")
        for known, user in self.by_token.items():
            if hmac.compare_digest(known.encode(), token.strip().encode()):
                return user
        raise ApiError(401, "unknown token", "authentication_error", code="invalid_api_key")

    def _gateway(self) -> Gateway:
        if self.gateway is None or not self.gateway.ready:
            raise ApiError(503, "the cluster is not available yet (being planned or deployed "
                                "again); retry shortly", "server_error", code="unavailable")
        return self.gateway

    # ---- replies -------------------------------------------------------------------------
    async def _pieces(self, request: Request, sink: HttpSink
                      ) -> AsyncIterator[tuple[str, Token | None, Finished | None]]:
        """(text, its Token, None) per piece, then ("", None, Finished). Raises ApiError if
        the request failed. The request is cancelled if the client goes or the caller stops."""
        watcher = asyncio.get_running_loop().create_task(self._watch(request, sink))
        try:
            while True:
                try:
                    msg = await asyncio.wait_for(sink.queue.get(), self.cfg.sse_keepalive_s)
                except TimeoutError:
                    yield "", None, None  # nothing yet (a long prompt): the caller may keep alive
                    continue
                if msg is None:  # the client went away
                    return
                if isinstance(msg, Token):
                    if msg.piece.text or msg.piece.logprob is not None:
                        yield msg.piece.text, msg, None
                elif isinstance(msg, Finished):
                    sink.done = True
                    if msg.text:
                        yield msg.text, None, None
                    yield "", None, msg
                    return
                elif isinstance(msg, Failed):
                    raise ApiError(503 if self.gateway is None or not self.gateway.ready else 500,
                                   msg.message, "server_error")
        finally:
            if not sink.gone:  # ended early (an error, the client left)
                sink.gone = True
                if self.gateway is not None:
                    self.gateway.wake.set()
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    def _scores(self, call: Call, pieces: list[Token]) -> dict[str, Any] | None:
        """OpenAI's `logprobs` object for these tokens (None: not asked for)."""
        if call.ask.logprobs is None or self.gateway is None:
            return None
        return logprob_block(call.chat, pieces, self.gateway.tok)

    async def _watch(self, request: Request, sink: HttpSink) -> None:
        """Wait for the client to disconnect; then cancel its request at once."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                break
        if not sink.gone and not sink.done:
            self.disconnects += 1
            log.info("%s (%s) disconnected; its request is cancelled", sink.peer, sink.user.name)
            sink.gone = True
            sink.queue.put_nowait(None)
            if self.gateway is not None:
                self.gateway.wake.set()

    async def _whole(self, request: Request, sink: HttpSink, call: Call, name: str) -> Response:
        parts: list[str] = []
        scored: list[Token] = []
        done: Finished | None = None
        try:
            async for text, piece, end in self._pieces(request, sink):
                parts.append(text)
                if piece is not None and piece.piece.logprob is not None:
                    scored.append(piece)
                done = end or done
        except ApiError as exc:
            return exc.response()
        if done is None:
            return Response(status_code=499)  # the client left: nobody reads this
        return JSONResponse(completion(call, name, self.model_id, "".join(parts), done,
                                       self._scores(call, scored)))

    async def _events(self, request: Request, sink: HttpSink, call: Call, name: str
                      ) -> AsyncIterator[bytes]:
        chunks = Chunks(call, name, self.model_id, int(time.time()))
        if call.chat:
            yield chunks.opening()
        try:
            async for text, piece, done in self._pieces(request, sink):
                if done is not None:
                    for chunk in chunks.ending(done):
                        yield chunk
                    return
                if text or piece is not None:
                    yield chunks.piece(text, self._scores(call, [piece]) if piece is not None else None)
                else:
                    yield KEEP_ALIVE
        except ApiError as exc:
            for chunk in error_event(exc):
                yield chunk


async def read_body(request: Request, cfg: HttpConfig) -> dict[str, Any]:
    """A request's JSON object, read within HttpConfig's bounds (ApiError otherwise)."""
    try:
        size = int(request.headers.get("content-length") or 0)
    except ValueError as exc:
        raise ApiError(400, "Content-Length is not a number") from exc
    parts = request.stream()
    if size > cfg.max_body_bytes:
        if size <= cfg.refused_body_drain_bytes:  # (larger: answered unread)
            await _drain(parts, 0, cfg)
        raise ApiError(413, f"request body of {size} bytes exceeds {cfg.max_body_bytes}")
    raw = bytearray()
    try:
        async with asyncio.timeout(cfg.body_timeout_s):
            async for part in parts:
                raw += part  # (a bytearray grows in place)
                if len(raw) > cfg.max_body_bytes:
                    await _drain(parts, len(raw), cfg)
                    raise ApiError(413, f"request body exceeds {cfg.max_body_bytes} bytes")
    except TimeoutError as exc:
        raise ApiError(408, f"the request body did not arrive within {cfg.body_timeout_s:g} s "
                            f"(body_timeout_s)") from exc
    try:  # (off the event loop: a large body takes a while)
        body = await asyncio.to_thread(json.loads, bytes(raw))
    except ValueError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from exc
    except RecursionError as exc:
        raise ApiError(400, "the body's JSON is nested too deeply") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


async def _drain(parts: AsyncIterator[bytes], read: int, cfg: HttpConfig) -> None:
    """Read and drop the rest of a refused body (`read` bytes of it read so far), up to
    refused_body_drain_bytes and for at most refused_body_drain_s (HttpConfig); a client
    that leaves meanwhile ends it."""
    with contextlib.suppress(TimeoutError, ClientDisconnect):
        async with asyncio.timeout(cfg.refused_body_drain_s):
            async for part in parts:
                read += len(part)
                if read > cfg.refused_body_drain_bytes:
                    return


def _peer(request: Request) -> str:
    return "{}:{}".format(*request.client) if request.client else "http"


@contextlib.asynccontextmanager
async def served(api: HttpApi) -> AsyncIterator[int]:
    """Serve `api` in a task for the block; yields the bound port."""
    sock = api.bind()
    task = asyncio.get_running_loop().create_task(api.serve(sock), name="http")
    try:
        yield sock.getsockname()[1]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        sock.close()
