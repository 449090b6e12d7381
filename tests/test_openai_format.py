"""OpenAI's format both ways (serve/openai.py) and the native door's messages
(serve/native.py `wire`) from the gateway's events, with no server: requests read or refused
naming the field, replies and stream chunks shaped as OpenAI's clients read them."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from edgelite.config import WireLimits
from edgelite.net import messages as m
from edgelite.reply.loop import Piece
from edgelite.serve.events import Embedded, Failed, Finished, Token
from edgelite.serve.native import wire
from edgelite.serve.openai import (
    ApiError,
    Chunks,
    completion,
    embeddings,
    logprob_block,
    parse_call,
    parse_embedding,
)

pytestmark = pytest.mark.unit

MODEL = "tiny"
DONE = Finished(7, [5, 6], "eos", 2, 0, 3, 12.5, 40.0, text="!")


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"messages": [{"role": "user", "content": "hi"}], "best_of": 2}, 400, "best_of"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "other"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": True}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": [1]}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "grammar"}}, 400,
     "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": {"a": 1}}, 400, "tools"),
])
def test_a_chat_request_out_of_shape_is_refused_naming_its_field(body: dict, status: int, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_call(body, True, MODEL)
    assert (caught.value.status, caught.value.param) == (status, param), caught.value.body()


def test_a_chat_request_becomes_an_ask_with_its_own_settings() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    schema = {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}
    call = parse_call({"model": MODEL, "messages": [{"role": "user", "content": parts}],
                       "max_completion_tokens": 9, "stop": "END", "logprobs": True, "top_logprobs": 2,
                       "stream": True, "stream_options": {"include_usage": False},
                       "response_format": schema}, True, MODEL)
    ask = call.ask
    assert ask.messages == [{"role": "user", "content": "ab"}] and ask.max_tokens == 9
    assert ask.stop == ("END",) and ask.logprobs == 2 and ask.response_format == "json_schema"
    assert json.loads(ask.json_schema or "") == {"type": "object"}
    assert call.stream and not call.include_usage and call.chat
    legacy = parse_call({"prompt": ["once"], "logprobs": 3}, False, MODEL)
    assert legacy.ask.text == "once" and legacy.ask.logprobs == 3 and not legacy.chat


def test_embedding_requests_take_texts_only() -> None:
    assert parse_embedding({"input": "a"}, MODEL, 4) == (["a"], False)
    assert parse_embedding({"input": ["a", "b"], "encoding_format": "base64"}, MODEL, 4) == (["a", "b"], True)
    for bad in ({"input": [1, 2]}, {"input": ["a"] * 5}, {"input": ""},
                {"input": "a", "encoding_format": "hex"}):
        with pytest.raises(ApiError):
            parse_embedding(bad, MODEL, 4)


def test_a_whole_reply_and_its_stream_carry_the_same_figures() -> None:
    call = parse_call({"messages": [{"role": "user", "content": "hi"}], "stream": True}, True, MODEL)
    whole = completion(call, "id1", MODEL, "ok!", DONE, None)
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "ok!"}
    assert whole["choices"][0]["finish_reason"] == "stop"  # (eos)
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    chunks = Chunks(call, "id1", MODEL, 1)
    events = [chunks.opening(), chunks.piece("ok", None), *chunks.ending(DONE)]
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") for e in events)
    assert events[-1] == b"data: [DONE]\n\n"
    bodies = [json.loads(e[6:]) for e in events[:-1]]
    assert [b["choices"][0]["delta"] for b in bodies] == [{"role": "assistant", "content": ""},
                                                          {"content": "ok"}, {}]
    assert bodies[-1]["choices"][0]["finish_reason"] == "stop" and bodies[-1]["usage"] == whole["usage"]
    assert bodies[-1]["edgelite"] == whole["edgelite"] == {"token_ids": [5, 6], "tier": 2, "ttft_ms": 12.5,
                                                           "decode_tok_s": 40.0}


def test_a_tool_call_is_openais_tool_calls() -> None:
    call = parse_call({"messages": [{"role": "user", "content": "w?"}]}, True, MODEL)
    done = Finished(1, [4], "tool_calls", 0, 0, 2, None, 0.0,
                    tool_call=json.dumps({"name": "weather", "arguments": {"city": "oslo"}}))
    msg = completion(call, "x", MODEL, "", done, None)["choices"][0]
    assert msg["finish_reason"] == "tool_calls" and msg["message"]["content"] is None
    fn = msg["message"]["tool_calls"][0]["function"]
    assert fn["name"] == "weather" and json.loads(fn["arguments"]) == {"city": "oslo"}


class Letters:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(96 + i) for i in ids)


def test_log_probabilities_in_both_shapes() -> None:
    tokens = [Token(1, Piece("a", 1, -0.1, ((1, -0.1), (2, -2.5)))), Token(1, Piece("b", 2, -0.7, ()))]
    chat = logprob_block(True, tokens, Letters())  # type: ignore[arg-type]
    assert chat["content"][0] == {"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -0.1, "bytes": [97]}, {"token": "b", "logprob": -2.5, "bytes": [98]}]}
    legacy = logprob_block(False, tokens, Letters())  # type: ignore[arg-type]
    assert legacy == {"tokens": ["a", "b"], "token_logprobs": [-0.1, -0.7],
                      "top_logprobs": [{"a": -0.1, "b": -2.5}, {}], "text_offset": [0, 1]}


def test_embeddings_as_numbers_or_little_endian_float32() -> None:
    got = [Embedded(1, [0.5, -1.0], 3, 0), Embedded(2, [2.0, 0.25], 4, 0)]
    floats = embeddings(got, MODEL, False)
    assert [d["embedding"] for d in floats["data"]] == [[0.5, -1.0], [2.0, 0.25]]
    assert floats["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    packed = embeddings(got, MODEL, True)["data"][1]["embedding"]
    assert np.frombuffer(base64.b64decode(packed), "<f4").tolist() == [2.0, 0.25]


def test_each_event_is_a_native_message_that_parses_back() -> None:
    events = [Token(3, Piece("x", 9, -0.5, ((9, -0.5),))), DONE, Embedded(4, [1.0], 2, 1), Failed(5, "no")]
    want = [m.TokenPiece, m.Done, m.Embedded, m.Error]
    for event, kind in zip(events, want, strict=True):
        msg = wire(event)
        back = m.parse(msg.to_wire(), WireLimits())
        assert isinstance(back, kind) and back == msg
    assert wire(DONE).token_ids == [5, 6] and wire(Failed(5, "no")).message == "no"
