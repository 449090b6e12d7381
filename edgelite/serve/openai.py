"""OpenAI's format, both ways: a chat or completions request's JSON as an `Ask` (its types and
this door's fields checked here, the values' rules by the gateway, serve/ask.py), an
embeddings request as its texts, and the gateway's events (serve/events.py) as OpenAI's
responses, stream chunks, log probabilities and errors. serve/http.py serves it."""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.responses import JSONResponse

from edgelite.reply.tokenizer import Tokenizer
from edgelite.serve.ask import Ask
from edgelite.serve.events import Embedded, Finished, Token


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


@dataclass
class Call:
    """A completion request as this door reads it."""

    ask: Ask
    stream: bool
    include_usage: bool
    chat: bool


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


def logprob_block(chat: bool, tokens: list[Token], tok: Tokenizer) -> dict[str, Any]:
    """Tokens' log probabilities as OpenAI shapes them: chat's `content` list, or the legacy
    completions' parallel lists."""
    scored = [t.piece for t in tokens]

    def text(token: int | None) -> str:
        return "" if token is None else tok.decode([token])

    if chat:
        def entry(token: int | None, lp: float) -> dict[str, Any]:
            t = text(token)
            return {"token": t, "logprob": lp, "bytes": list(t.encode())}

        return {"content": [{**entry(p.token_id, p.logprob or 0.0), "top_logprobs": [
            entry(t, lp) for t, lp in p.top]} for p in scored]}
    texts = [text(p.token_id) for p in scored]
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [p.logprob for p in scored],
            "top_logprobs": [{text(t): lp for t, lp in p.top} for p in scored],
            "text_offset": offsets}


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


def _tool_calls(done: Finished, stream: bool) -> list[dict[str, Any]]:
    """A reply's call in OpenAI's shape (a stream's delta carries its index)."""
    call = json.loads(done.tool_call)
    entry: dict[str, Any] = {"id": "call_" + secrets.token_hex(12), "type": "function",
                             "function": {"name": call["name"],
                                          "arguments": json.dumps(call["arguments"])}}
    return [{"index": 0, **entry} if stream else entry]


def _usage(done: Finished) -> dict[str, int]:
    n = len(done.token_ids)
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": n,
            "total_tokens": done.prompt_tokens + n}


def _extra(done: Finished) -> dict[str, Any]:
    """edgelite's own fields (OpenAI clients ignore them): the ids, the tier, timings."""
    return {"token_ids": list(done.token_ids), "tier": done.tier, "ttft_ms": done.ttft_ms,
            "decode_tok_s": done.decode_tok_s}

def completion(call: Call, name: str, model_id: str, text: str, done: Finished,
               scores: dict[str, Any] | None) -> dict[str, Any]:
    """A whole reply (`stream` false) as OpenAI's chat.completion or text_completion."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(done.finish), "logprobs": scores}
    if call.chat:
        choice["message"] = {"role": "assistant", "content": text}
        if done.tool_call:
            choice["message"] = {"role": "assistant", "content": None,
                                 "tool_calls": _tool_calls(done, stream=False)}
    else:
        choice["text"] = text
    return {"id": name, "object": "chat.completion" if call.chat else "text_completion",
            "created": int(time.time()), "model": model_id, "choices": [choice],
            "usage": _usage(done), "edgelite": _extra(done)}


@dataclass(frozen=True)
class Chunks:
    """A streamed reply's server-sent events, each a chunk of OpenAI's shape."""

    call: Call
    name: str
    model_id: str
    created: int

    def opening(self) -> bytes:
        return self._event({"role": "assistant", "content": ""})

    def piece(self, text: str, scores: dict[str, Any] | None) -> bytes:
        return self._event({"content": text} if self.call.chat else text, None, scores)

    def ending(self, done: Finished) -> Iterator[bytes]:
        """The last chunks: a tool call's, the finish reason (usage if asked), [DONE]."""
        if done.tool_call and self.call.chat:
            yield self._event({"tool_calls": _tool_calls(done, stream=True)})
        extra = {"usage": _usage(done)} if self.call.include_usage else {}
        yield self._event({} if self.call.chat else "", _finish(done.finish), **extra,
                          edgelite=_extra(done))
        yield DONE

    def _event(self, delta: dict[str, Any] | str, finish: str | None = None,
               scores: dict[str, Any] | None = None, **extra: Any) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": scores}
        choice["delta" if self.call.chat else "text"] = delta
        body = {"id": self.name, "object": "chat.completion.chunk" if self.call.chat
                else "text_completion", "created": self.created, "model": self.model_id,
                "choices": [choice], **extra}
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"


def error_event(exc: ApiError) -> Iterator[bytes]:
    """A stream that fails after it began: the error's JSON, then [DONE]."""
    yield b"data: " + json.dumps(exc.body()).encode() + b"\n\n"
    yield DONE


def embeddings(got: list[Embedded], model_id: str, as_base64: bool) -> dict[str, Any]:
    """Embeddings in OpenAI's list (base64: little-endian float32, what the `openai` package
    asks for)."""
    used = sum(e.prompt_tokens for e in got)
    data = [{"object": "embedding", "index": i, "embedding": base64.b64encode(
        np.asarray(e.vector, "<f4").tobytes()).decode() if as_base64 else e.vector}
        for i, e in enumerate(got)]
    return {"object": "list", "data": data, "model": model_id,
            "usage": {"prompt_tokens": used, "total_tokens": used}}
