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
import base64
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

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from edgelite.config import HttpConfig
from edgelite.errors import ProtocolError, QueueFull
from edgelite.net import messages as m
from edgelite.net.frames import listen_error
from edgelite.net.schema import Message
from edgelite.reply.tokenizer import Tokenizer
from edgelite.serve.ask import Ask, AskError
from edgelite.serve.gateway import Gateway
from edgelite.serve.metrics import prometheus
from edgelite.serve.page import page_html
from edgelite.serve.users import ANONYMOUS, User

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: Ctrl-C belongs to the command that runs us."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _protocol(cfg: HttpConfig) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the bounds it lacks: at most `max_connections` open, and
    `max_connections_per_address` from one address (more are closed as they come: one
    stranger cannot fill the server), and a request's headers must be in within `header_timeout_s`
    of the connection (or of the previous reply): a client that opens connections and sends
    nothing, or its headers a byte at a time, holds nothing for long."""

    per_address: dict[str, int] = {}  # open connections by client address

    class Bounded(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._deadline: asyncio.TimerHandle | None = None
            self._host = self.client[0] if self.client else "?"
            per_address[self._host] = per_address.get(self._host, 0) + 1
            if (len(self.connections) > cfg.max_connections
                    or per_address[self._host] > cfg.max_connections_per_address):
                log.info("HTTP connection from %s closed: %d open, %d from there "
                         "(max_connections, max_connections_per_address)", self.client,
                         len(self.connections) - 1, per_address[self._host] - 1)
                transport.close()
                return
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
                per_address[host] -= 1
                if not per_address[host]:
                    del per_address[host]
            super().connection_lost(exc)

    return Bounded


class ApiError(Exception):
    """An error answered as OpenAI's error JSON with this HTTP status."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


@dataclass(eq=False)
class HttpSink:
    """One HTTP request as the gateway sees a client: what it posts lands in `queue`."""

    user: User
    peer: str
    gone: bool = False
    done: bool = False  # its reply ended (a client that leaves after that did not cut it short)
    queue: asyncio.Queue[Message | None] = field(default_factory=asyncio.Queue)

    def post(self, msg: Message) -> None:
        if not self.gone:
            self.queue.put_nowait(msg)  # unbounded: a request posts at most max_tokens + 1


@dataclass
class Call:
    """A completion request as this door reads it."""

    ask: Ask
    stream: bool
    include_usage: bool
    chat: bool


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
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
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
        gw = self.gateway
        if gw is None:
            return JSONResponse({"status": "starting", "detail": "the cluster is being planned "
                                 "and deployed"}, status_code=503)
        if not gw.ready:
            return JSONResponse({"status": "unavailable", "detail": "a node was lost; the plan "
                                 "is being deployed again"}, status_code=503)
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

    async def embeddings(self, request: Request) -> Response:
        """Each input's embedding, one after another through the gateway's queue."""
        try:
            user = self._user(request)
            texts, as_base64 = parse_embedding(await read_body(request, self.cfg), self.model_id,
                                               self.cfg.max_embedding_inputs)
            gw = self._gateway()
            data, used = [], 0
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
                used += got.prompt_tokens
                vector = (base64.b64encode(np.asarray(got.vector, "<f4").tobytes()).decode()
                          if as_base64 else got.vector)
                data.append({"object": "embedding", "index": i, "embedding": vector})
        except ApiError as exc:
            return exc.response()
        self.requests_total += 1
        return JSONResponse({"object": "list", "data": data, "model": self.model_id,
                             "usage": {"prompt_tokens": used, "total_tokens": used}})

    async def _embedded(self, request: Request, sink: HttpSink) -> m.Embedded | None:
        """The gateway's answer to an embedding (None: the client left, which cancels it)."""
        watcher = asyncio.get_running_loop().create_task(self._watch(request, sink))
        try:
            msg = await sink.queue.get()
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        if isinstance(msg, m.Error):
            raise ApiError(500, msg.message, "server_error")
        if not isinstance(msg, m.Embedded):
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
                      ) -> AsyncIterator[tuple[str, m.TokenPiece | None, m.Done | None]]:
        """(text, its TokenPiece, None) per piece, then ("", None, Done). Raises ApiError if
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
                if isinstance(msg, m.TokenPiece):
                    if msg.text or msg.logprob is not None:
                        yield msg.text, msg, None
                elif isinstance(msg, m.Done):
                    sink.done = True
                    if msg.text:
                        yield msg.text, None, None
                    yield "", None, msg
                    return
                elif isinstance(msg, m.Error):
                    raise ApiError(503 if self.gateway is None or not self.gateway.ready else 500,
                                   msg.message, "server_error")
        finally:
            if not sink.gone:  # ended early (an error, the client left)
                sink.gone = True
                if self.gateway is not None:
                    self.gateway.wake.set()
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    def _scores(self, call: Call, pieces: list[m.TokenPiece]) -> dict[str, Any] | None:
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
        scored: list[m.TokenPiece] = []
        done: m.Done | None = None
        try:
            async for text, piece, end in self._pieces(request, sink):
                parts.append(text)
                if piece is not None and piece.logprob is not None:
                    scored.append(piece)
                done = end or done
        except ApiError as exc:
            return exc.response()
        if done is None:
            return Response(status_code=499)  # the client left: nobody reads this
        text = "".join(parts)
        choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(done.finish),
                                  "logprobs": self._scores(call, scored)}
        if call.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if done.tool_call:
                choice["message"] = {"role": "assistant", "content": None,
                                     "tool_calls": _tool_calls(done, stream=False)}
        else:
            choice["text"] = text
        return JSONResponse({
            "id": name, "object": "chat.completion" if call.chat else "text_completion",
            "created": int(time.time()), "model": self.model_id, "choices": [choice],
            "usage": _usage(done), "edgelite": _extra(done)})

    async def _events(self, request: Request, sink: HttpSink, call: Call, name: str
                      ) -> AsyncIterator[bytes]:
        created, kind = int(time.time()), "chat.completion.chunk" if call.chat else "text_completion"

        def chunk(delta: dict[str, Any] | str, finish: str | None = None,
                  scores: dict[str, Any] | None = None, **extra: Any) -> bytes:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": scores}
            if call.chat:
                choice["delta"] = delta
            else:
                choice["text"] = delta
            body = {"id": name, "object": kind, "created": created, "model": self.model_id,
                    "choices": [choice], **extra}
            return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

        if call.chat:
            yield chunk({"role": "assistant", "content": ""})
        try:
            async for text, piece, done in self._pieces(request, sink):
                if done is not None:
                    if done.tool_call and call.chat:
                        yield chunk({"tool_calls": _tool_calls(done, stream=True)})
                    extra = {"usage": _usage(done)} if call.include_usage else {}
                    yield chunk({} if call.chat else "", _finish(done.finish), **extra,
                                edgelite=_extra(done))
                    yield b"data: [DONE]\n\n"
                    return
                if text or piece is not None:
                    scores = self._scores(call, [piece]) if piece is not None else None
                    yield chunk({"content": text} if call.chat else text, None, scores)
                else:
                    yield b": keep-alive\n\n"
        except ApiError as exc:
            yield b"data: " + json.dumps(exc.body()).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"


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


# the fields a request may have (any other is a 400 naming it: never ignored); `user` is an
# end user's name for the caller's own records and changes nothing
FIELDS = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
          "stream_options", "stop", "seed", "logprobs", "presence_penalty", "frequency_penalty",
          "response_format", "user", "top_k", "min_p", "repetition_penalty", "speculate"}
CHAT_FIELDS = FIELDS | {"messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"}
COMPLETION_FIELDS = FIELDS | {"prompt"}


def _check_fields(body: dict[str, Any], fields: set[str], model_id: str) -> None:
    """A body's fields are among `fields` (400 naming the first other), its model this one
    (404)."""
    unknown = sorted(set(body) - fields)
    if unknown:
        raise ApiError(400, f"field {unknown[0][:64]!r} is not supported by this server",
                       param=unknown[0][:64])
    model = body.get("model", model_id)
    if model != model_id:
        raise ApiError(404, f"model {str(model)[:64]!r} is not served here; this server has "
                            f"{model_id!r}", param="model", code="model_not_found")


def _peer(request: Request) -> str:
    return "{}:{}".format(*request.client) if request.client else "http"


def parse_call(body: dict[str, Any], chat: bool, model_id: str) -> Call:
    """The request in OpenAI's JSON: its types and this door's own fields are checked
    here, the values' rules by the gateway (serve/ask.py)."""
    _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, model_id)
    n = body.get("n", 1)
    if n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    # (refused, not ignored: a client relying on them would get wrong behaviour silently)
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    schema_text = None
    if kind == "json_schema" and isinstance(fmt, dict):
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ApiError(400, "response_format json_schema needs json_schema.schema, an "
                                "object", param="response_format")
        schema_text = json.dumps(spec["schema"])
    elif fmt not in (None, {"type": "text"}, {"type": "json_object"}):
        raise ApiError(400, f"response_format {str(kind)[:32]!r} is not supported by this "
                            f"server (text, json_object and json_schema are)",
                       param="response_format")
    tools, tool_choice = _tools(body, chat)
    messages, text = None, None
    if chat:
        messages = _messages(body.get("messages"))
    else:
        text = body.get("prompt")
        if isinstance(text, list) and len(text) == 1:
            text = text[0]
        if not isinstance(text, str):
            raise ApiError(400, "prompt must be a string", param="prompt")
    if "max_completion_tokens" in body:
        body["max_tokens"] = body["max_completion_tokens"]
    ask = Ask(messages=messages, text=text, max_tokens=_number(body, "max_tokens", int),
              temperature=_number(body, "temperature", float),
              top_p=_number(body, "top_p", float), seed=_number(body, "seed", int),
              stop=_stops(body.get("stop")), speculate=_text(body, "speculate"),
              top_k=_number(body, "top_k", int), min_p=_number(body, "min_p", float),
              presence_penalty=_number(body, "presence_penalty", float),
              frequency_penalty=_number(body, "frequency_penalty", float),
              repetition_penalty=_number(body, "repetition_penalty", float),
              logprobs=_logprobs(body, chat),
              response_format=kind if isinstance(fmt, dict) else None, json_schema=schema_text,
              tools=tools, tool_choice=tool_choice)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    return Call(ask, stream, bool(options.get("include_usage", True)), chat)


EMBEDDING_FIELDS = {"model", "input", "encoding_format", "user"}


def parse_embedding(body: dict[str, Any], model_id: str, most: int) -> tuple[list[str], bool]:
    """An embeddings request: its texts (at most `most`), and whether the vectors go as
    base64 (little-endian float32, what the `openai` package asks for) rather than numbers."""
    _check_fields(body, EMBEDDING_FIELDS, model_id)
    raw = body.get("input")
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not 0 < len(texts) <= most or not all(
            isinstance(t, str) and t for t in texts):
        raise ApiError(400, f"input must be a non-empty string or a list of 1 to {most} of "
                            f"them (token ids are not taken)", param="input")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise ApiError(400, "encoding_format must be float or base64", param="encoding_format")
    return texts, fmt == "base64"


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """Alternatives per token asked for (None: no log probabilities): chat's `logprobs`
    (true/false) with `top_logprobs`, or the legacy completions' `logprobs` count."""
    if not chat:
        return _number(body, "logprobs", int)
    wanted = body.get("logprobs", False)
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(400, "logprobs must be true or false", param="logprobs")
    top = _number(body, "top_logprobs", int)
    if top is not None and not wanted:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


def logprob_block(chat: bool, pieces: list[m.TokenPiece], tok: Tokenizer) -> dict[str, Any]:
    """Tokens' log probabilities as OpenAI shapes them: chat's `content` list, or the legacy
    completions' parallel lists."""
    def text(token: int) -> str:
        return tok.decode([token])

    if chat:
        def entry(token: int, lp: float) -> dict[str, Any]:
            t = text(token)
            return {"token": t, "logprob": lp, "bytes": list(t.encode())}

        return {"content": [{**entry(p.token_id, p.logprob or 0.0), "top_logprobs": [
            entry(t, lp) for t, lp in zip(p.top_ids, p.top_logprobs, strict=True)]} for p in pieces]}
    tokens = [text(p.token_id) for p in pieces]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [p.logprob for p in pieces],
            "top_logprobs": [{text(t): lp for t, lp in zip(p.top_ids, p.top_logprobs, strict=True)}
                             for p in pieces], "text_offset": offsets}


def _tools(body: dict[str, Any], chat: bool) -> tuple[str | None, str | None]:
    """`tools` as JSON text (their rules: reply/tools.py, through the gateway) and
    `tool_choice` as a word or a tool's name."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and not chat:
        raise ApiError(400, "tools go with /v1/chat/completions", param="tools")
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "tools must be a list of {type: function, function}", param="tools")
    if isinstance(choice, dict):
        fn = choice.get("function")
        choice = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(choice, str):
            raise ApiError(400, "tool_choice must be auto, none, required or {type: function, "
                                "function: {name}}", param="tool_choice")
    elif choice is not None and not isinstance(choice, str):
        raise ApiError(400, "tool_choice must be a string or an object", param="tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "parallel_tool_calls must be true or false", param="parallel_tool_calls")
    return (json.dumps(tools) if tools else None), choice


def _calls(raw: Any, i: int) -> str:
    """An assistant message's `tool_calls` (OpenAI's, arguments as JSON text) as the gateway
    takes them: JSON text of [{name, arguments}]."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(raw, list):
        raise ApiError(400, f"{where} must be a list", param="messages")
    out = []
    for call in raw:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments"), str):
            raise ApiError(400, f"{where}: each call is {{type: function, function: {{name, "
                                f"arguments}}}} with arguments as JSON text", param="messages")
        try:
            args = json.loads(fn["arguments"])
        except (ValueError, RecursionError):
            raise ApiError(400, f"{where}: arguments of {fn['name'][:32]!r} are not JSON",
                           param="messages") from None
        out.append({"name": fn["name"], "arguments": args})
    return json.dumps(out)


def _messages(raw: Any) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages must be a non-empty list of {role, content}", param="messages")
    out = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a role", param="messages")
        content = msg.get("content")
        if msg.get("tool_calls") and msg["role"] == "assistant":
            out.append({"role": "assistant", "content": content if isinstance(content, str) else "",
                        "tool_calls": _calls(msg["tool_calls"], i)})
            continue
        if isinstance(content, list):  # [{type: text, text}] parts
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                               param="messages")
            content = "".join(texts)  # type: ignore[arg-type]
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", param="messages")
        out.append({"role": msg["role"], "content": content})
    return out


def _number(body: dict[str, Any], name: str, kind: type) -> Any:
    """A numeric field of the body (None: absent); its range is the gateway's rule."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        raise ApiError(400, f"{name} must be {'an integer' if kind is int else 'a number'}", param=name)
    return kind(value)


def _text(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"{name} must be a string", param=name)
    return value


def _stops(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    return tuple(stops)


def _finish(finish: str) -> str:
    return finish if finish in ("length", "tool_calls") else "stop"  # eos and stop strings: "stop"


def _tool_calls(done: m.Done, stream: bool) -> list[dict[str, Any]]:
    """A reply's call in OpenAI's shape (a stream's delta carries its index)."""
    call = json.loads(done.tool_call)
    entry: dict[str, Any] = {"id": "call_" + secrets.token_hex(12), "type": "function",
                             "function": {"name": call["name"],
                                          "arguments": json.dumps(call["arguments"])}}
    return [{"index": 0, **entry} if stream else entry]


def _usage(done: m.Done) -> dict[str, int]:
    n = len(done.token_ids)
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": n,
            "total_tokens": done.prompt_tokens + n}


def _extra(done: m.Done) -> dict[str, Any]:
    """edgelite's own fields (OpenAI clients ignore them): the ids, the tier, timings."""
    return {"token_ids": list(done.token_ids), "tier": done.tier, "ttft_ms": done.ttft_ms,
            "decode_tok_s": done.decode_tok_s}


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
