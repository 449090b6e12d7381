"""The gateway's two front doors, the wire protocol (serve/native.py) and the OpenAI API
(serve/http.py), in front of one gateway over real sockets: the same invalid requests are
refused by the same rule in the same words, and the same valid request (stop strings
included) gives the same reply."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import pytest

from edgelite.client.local import LocalBackend
from edgelite.config import GatewayConfig, GenerationConfig, HttpConfig, SchedulerConfig
from edgelite.ids import NodeAddr
from edgelite.manifest import load
from edgelite.net import messages as m
from edgelite.reply.jsonprefix import JsonPrefix
from edgelite.reply.jsonschema import fits
from edgelite.reply.tokenizer import Tokenizer
from edgelite.serve.client import GatewayClient
from edgelite.serve.gateway import Gateway
from edgelite.serve.http import HttpApi, served
from edgelite.serve.native import NativeDoor
from edgelite.serve.scheduler import Scheduler
from edgelite.serve.users import User

pytestmark = pytest.mark.e2e

USERS = {"u": User("u", "t-u", 1)}
HI = [{"role": "user", "content": "hello there"}]
# (what is wrong, the request's fields as both doors take them)
INVALID: list[tuple[str, dict[str, Any]]] = [
    ("temperature", {"messages": HI, "temperature": 5.0}),
    ("top_p", {"messages": HI, "top_p": 1.5}),
    ("max_tokens low", {"messages": HI, "max_tokens": 0}),
    ("max_tokens high", {"messages": HI, "max_tokens": 100_000}),
    ("seed", {"messages": HI, "seed": -1}),
    ("role", {"messages": [{"role": "robot", "content": "beep"}]}),
    ("no messages", {"messages": []}),
    ("too long", {"messages": [{"role": "user", "content": "x" * 600}]}),
    ("five stops", {"messages": HI, "stop": ["a", "b", "c", "d", "e"]}),
    ("empty stop", {"messages": HI, "stop": [""]}),
    ("speculate", {"messages": HI, "speculate": "draft"}),
]


def _post(base: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": "Bearer t-u"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def _native(client: GatewayClient, rid: int, body: dict[str, Any]) -> m.Message:
    fields = {k: v for k, v in body.items() if k != "messages"}
    await client.conn.send(m.GenerateRequest(
        id=rid, messages=[m.ChatMessage(role=x["role"], content=x["content"]) for x in body["messages"]],
        **fields))
    while True:
        msg = await asyncio.wait_for(client.conn.recv(), 30)
        if getattr(msg, "id", None) == rid and isinstance(msg, m.Error | m.Done):
            return msg


@contextlib.asynccontextmanager
async def _doors(manifest, cfg: GatewayConfig, sched: Scheduler
                 ) -> AsyncIterator[tuple[Gateway, LocalBackend, str, GatewayClient]]:
    """One gateway on the local engine behind both doors: (gateway, backend, the HTTP base
    address, a native client of user u)."""
    backend = LocalBackend(manifest)
    gw = Gateway(backend, Tokenizer(manifest), USERS, sched, cfg, GenerationConfig(max_tokens=8))
    door = NativeDoor(gw, USERS, cfg)
    await door.start()
    api = HttpApi(manifest.name, USERS, HttpConfig(port=0))
    api.gateway = gw
    running = asyncio.get_running_loop().create_task(gw.run())
    try:
        async with served(api) as port:
            client = await GatewayClient.connect(NodeAddr("127.0.0.1", door.port), "u", "t-u")
            try:
                yield gw, backend, f"http://127.0.0.1:{port}", client
            finally:
                await client.close()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        door.close()
        await backend.close()


@pytest.mark.e2e
def test_both_doors_refuse_alike_and_answer_alike(exported) -> None:
    manifest = load(exported["llama"])
    cfg = GatewayConfig(port=0, max_prompt_chars=500)

    async def main() -> None:
        sched = Scheduler(SchedulerConfig(context_limit=manifest.max_positions, kv_tokens=4096))
        async with _doors(manifest, cfg, sched) as (gw, _, base, client):
            for i, (what, body) in enumerate(INVALID):
                status, answer = await asyncio.to_thread(_post, base, {"model": manifest.name,
                                                                       **body})
                native = await _native(client, i, body)
                assert status == 400, (what, status, answer)
                assert isinstance(native, m.Error), (what, native)
                assert answer["error"]["message"] == native.message, what
            # one valid request with a stop string, through both doors
            ask = {"messages": HI, "max_tokens": 12, "temperature": 0.0}
            status, whole = await asyncio.to_thread(_post, base, {"model": manifest.name, **ask})
            assert status == 200, whole
            text = whole["choices"][0]["message"]["content"]
            assert len(text) >= 4, text
            stop = text[2:4]
            status, cut = await asyncio.to_thread(
                _post, base, {"model": manifest.name, **ask, "stop": [stop]})
            native = await _native(client, 99, {**ask, "stop": [stop]})
            assert isinstance(native, m.Done) and native.finish == "stop"
            assert cut["choices"][0]["finish_reason"] == "stop"
            assert cut["edgelite"]["token_ids"] == list(native.token_ids)
            assert cut["choices"][0]["message"]["content"] == text[:text.find(stop)]
            pieces = "".join([p async for p in client.generate(HI, GenerationConfig(
                max_tokens=12, stop=(stop,)))])
            assert pieces == text[:text.find(stop)]
            # prompt lookup in the gateway: the same greedy ids, drafts verified
            echo = {"messages": [{"role": "user", "content": "a b c d e f g " * 6}],
                    "max_tokens": 24, "temperature": 0.0}
            plain = await _native(client, 100, echo)
            fast = await _native(client, 101, {**echo, "speculate": "lookup"})
            status, http = await asyncio.to_thread(
                _post, base, {"model": manifest.name, **echo, "speculate": "lookup"})
            assert isinstance(plain, m.Done) and isinstance(fast, m.Done)
            assert list(fast.token_ids) == list(plain.token_ids) == http["edgelite"]["token_ids"]
            assert gw.pacer.measured and gw.pacer.accepted, "no drafts were verified"

    asyncio.run(main())


@pytest.mark.e2e
def test_context_limits_are_named_and_long_prompts_are_chunked(exported) -> None:
    """A prompt past the model's context (256 positions here) is refused at once through both
    doors and by `generate`, naming the model's limit; one that fits gets its max_tokens cut
    to what is left (finish "length"); a prompt longer than the scheduler's step budget is
    prefilled over several steps instead of refused."""
    from edgelite.errors import EdgeliteError
    from edgelite.reply.generate import generate

    manifest = load(exported["llama"])
    cfg = GatewayConfig(port=0)
    words = " ".join(f"w{i}" for i in range(400))

    async def main() -> None:
        sched = Scheduler(SchedulerConfig(context_limit=manifest.max_positions, kv_tokens=4096,
                                          max_step_tokens=64))
        async with _doors(manifest, cfg, sched) as (_, backend, base, client):
            long = {"messages": [{"role": "user", "content": words}]}
            status, answer = await asyncio.to_thread(_post, base, {"model": manifest.name, **long})
            native = await _native(client, 1, long)
            assert status == 400 and isinstance(native, m.Error)
            assert answer["error"]["message"] == native.message
            assert "the model's context" in native.message and "256" in native.message
            tok = Tokenizer(manifest)
            fits = " ".join(words.split()[:60])
            n = len(tok.chat_prompt([{"role": "user", "content": fits}]))
            assert 64 < n < 250, n  # over the step budget, within the context
            done = await _native(client, 2, {"messages": [{"role": "user", "content": fits}],
                                             "max_tokens": 2000, "temperature": 0.0})
            assert isinstance(done, m.Done), done
            assert len(done.token_ids) <= 256 - n
            ids = tok.text_prompt(words)
            assert len(ids) > 256
            with pytest.raises(EdgeliteError, match="model's context"):
                async for _ in generate(backend, ids, GenerationConfig(max_tokens=4), reuse=False):
                    pass
            short = ids[:250]
            got = [p async for p in generate(backend, short, GenerationConfig(max_tokens=50), reuse=False)]
            assert len([p for p in got if p.token_id is not None]) <= 6

    asyncio.run(main())


@pytest.mark.e2e
def test_log_probabilities_and_sampling_controls(exported) -> None:
    """logprobs over HTTP (chat and legacy completions, whole and streamed) and natively:
    greedy picks the likeliest, so each token's log probability is its first alternative's;
    top_k 1 and min_p 1 sample as greedy does at temperature 1; a large frequency penalty
    makes a greedy reply repeat no token."""
    manifest = load(exported["llama"])
    cfg = GatewayConfig(port=0)

    async def main() -> None:
        sched = Scheduler(SchedulerConfig(context_limit=manifest.max_positions, kv_tokens=4096))
        async with _doors(manifest, cfg, sched) as (_, _b, base, client):
            ask = {"messages": HI, "max_tokens": 10, "temperature": 0.0}
            status, whole = await asyncio.to_thread(
                _post, base, {"model": manifest.name, **ask, "logprobs": True, "top_logprobs": 3})
            assert status == 200, whole
            content = whole["choices"][0]["logprobs"]["content"]
            assert len(content) == len(whole["edgelite"]["token_ids"])
            for c in content:
                assert len(c["top_logprobs"]) == 3 and c["logprob"] <= 0
                assert c["logprob"] == c["top_logprobs"][0]["logprob"]
                assert c["bytes"] == list(c["token"].encode())
            sse = urllib.request.Request(base + "/v1/chat/completions", json.dumps(
                {"model": manifest.name, **ask, "stream": True, "logprobs": True}).encode(),
                {"Content-Type": "application/json", "Authorization": "Bearer t-u"})
            lines = await asyncio.to_thread(
                lambda: urllib.request.urlopen(sse, timeout=30).read().decode().splitlines())
            chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            streamed = [c["choices"][0]["logprobs"]["content"][0]["logprob"] for c in chunks
                        if c["choices"][0].get("logprobs")]
            # (the same tokens; a reused prefix's KV may differ in the last bits)
            assert len(streamed) == len(content)
            assert max(abs(a - c["logprob"]) for a, c in zip(streamed, content, strict=True)) < 1e-4
            req = urllib.request.Request(base + "/v1/completions", json.dumps(
                {"model": manifest.name, "prompt": "hello", "max_tokens": 6, "temperature": 0,
                 "logprobs": 2}).encode(), {"Content-Type": "application/json",
                                           "Authorization": "Bearer t-u"})
            legacy = await asyncio.to_thread(
                lambda: json.loads(urllib.request.urlopen(req, timeout=30).read()))
            lp = legacy["choices"][0]["logprobs"]
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
            assert lp["text_offset"][0] == 0
            for extra in ({"response_format": {"type": "yaml"}},
                          {"logit_bias": {"1": 1.0}}):
                status, refused = await asyncio.to_thread(_post, base, {"model": manifest.name,
                                                                        **ask, **extra})
                assert status == 400 and refused["error"]["param"] in extra, refused
            native = await _native(client, 7, {**ask, "logprobs": 2})
            assert isinstance(native, m.Done)
            as_json = await _native(client, 13, {**ask, "response_format": "json_object"})
            assert isinstance(as_json, m.Done) and as_json.token_ids  # (the text: test_http)
            schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
            shaped = "".join([p async for p in client.generate(ask["messages"], GenerationConfig(
                max_tokens=12, response_format="json_schema", json_schema=json.dumps(schema)))])
            assert JsonPrefix().feed(shaped) and fits(schema, shaped), shaped
            wrong = await _native(client, 14, {**ask, "response_format": "yaml"})
            assert isinstance(wrong, m.Error) and "response_format" in wrong.message
            bad = await _native(client, 8, {**ask, "logprobs": 99})
            assert isinstance(bad, m.Error) and "top_logprobs" in bad.message
            greedy = await _native(client, 9, ask)
            for i, extra in enumerate(({"top_k": 1}, {"min_p": 1.0})):
                got = await _native(client, 10 + i, {**ask, "temperature": 1.0, "seed": 3, **extra})
                assert isinstance(got, m.Done) and list(got.token_ids) == list(greedy.token_ids), extra
            varied = await _native(client, 12, {**ask, "max_tokens": 24, "frequency_penalty": 2.0,
                                                "presence_penalty": 2.0, "repetition_penalty": 5.0})
            assert isinstance(varied, m.Done)
            assert len(set(varied.token_ids)) == len(varied.token_ids), varied.token_ids

    asyncio.run(main())
