"""Tool calls (reply/tools.py) and embeddings (reply/embed.py): what a request's tools may be,
how prompts show them, and calls and vectors through both gateway doors with the `openai`
package, on a tiny model whose template renders tools itself (`<tool_call>` tags)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
from typing import Any

import numpy as np
import openai
import pytest
from test_doors import _doors, _post

from edgelite.config import GatewayConfig, GenerationConfig, SchedulerConfig
from edgelite.errors import EdgeliteError
from edgelite.manifest import load
from edgelite.reply.embed import embed
from edgelite.reply.jsonschema import fits
from edgelite.reply.tokenizer import Tokenizer
from edgelite.reply.tools import call_schema, parse_tools, style_of
from edgelite.serve.scheduler import Scheduler

WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
# a template that renders tools itself and writes calls between <tool_call> tags (as Qwen 2.5's)
TAGGED = (
    "{%- if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.tool_calls %}<|im_start|>assistant\n{% for c in message.tool_calls %}"
    "<tool_call>\n{{ c.function | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>{{ message.content }}"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# a template that raises unless user and assistant turns alternate after a first system message
STRICT = ("{% if messages[0]['role'] == 'system' %}{% set rest = messages[1:] %}{% else %}"
          "{% set rest = messages %}{% endif %}{{ messages[0]['content'][:3] }}|"
          "{% for m in rest %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('roles must alternate') }}{% endif %}"
          "{{ m['role'] }}: {{ m['content'] }}|{% endfor %}")


def _valid(call: dict[str, Any]) -> bool:
    """A call of WEATHER or ADD with arguments of their types (checked here, not by the code
    that chose the tokens)."""
    args = call["arguments"]
    if call["name"] == "weather":
        return (set(args) <= {"city", "days"} and isinstance(args.get("city"), str)
                and isinstance(args.get("days", 0), int) and not isinstance(args.get("days"), bool))
    return (call["name"] == "add" and set(args) == {"a", "b"}
            and all(isinstance(v, int | float) and not isinstance(v, bool) for v in args.values()))


@pytest.mark.unit
def test_tools_outside_the_rules_are_refused_naming_what() -> None:
    assert [t.name for t in parse_tools(json.dumps([WEATHER, ADD]))] == ["weather", "add"]
    for tools, words in (({"a": 1}, "must be a list"), ([], "must be a list of 1"),
                         ([{"type": "retrieval"}], r"tools\[0\] must be"),
                         ([{"function": {"name": "no spaces"}}], "name must be"),
                         ([WEATHER, WEATHER], "'weather' is named twice"),
                         ([{"function": {"name": "f", "parameters": {"type": "array"}}}],
                          "must be of type object"),
                         ([{"function": {"name": "f", "parameters": {
                             "type": "object", "properties": {"x": {"pattern": "a"}}}}}],
                          "keyword 'pattern' is not supported")):
        with pytest.raises(EdgeliteError, match=words):
            parse_tools(json.dumps(tools))


@pytest.mark.unit
def test_a_calls_schema_takes_the_tools_calls_only() -> None:
    tools = parse_tools(json.dumps([WEATHER, ADD]))
    schema = call_schema(tools, "auto")
    for text in ('{"name": "weather", "arguments": {"city": "Oslo"}}',
                 '{"name": "add", "arguments": {"a": 1, "b": 2.5}}', '{"name": "we', '{"arguments'):
        assert fits(schema, text), text
    for text in ('{"name": "weather", "arguments": {"a": 1}}', '{"name": "sub"',
                 '{"name": "add", "arguments": {"a": 1}}', '{"name": "weather"}'):
        assert not fits(schema, text), text
    assert not fits(call_schema(tools, "add"), '{"name": "weather"')


@pytest.mark.engine
def test_prompts_show_tools_and_earlier_calls_as_the_template_writes_them(exported) -> None:
    manifest = load(exported["llama"])
    chatml, tagged = Tokenizer(manifest), Tokenizer(dataclasses.replace(manifest, chat_template=TAGGED))
    assert not chatml.tool_style.native and style_of(TAGGED).opening == "<tool_call>\n"
    turns = [{"role": "user", "content": "weather in oslo?"},
             {"role": "assistant", "content": "", "tool_calls": json.dumps(
                 [{"name": "weather", "arguments": {"city": "oslo"}}])},
             {"role": "tool", "content": "sunny"}]
    tools = json.dumps([WEATHER])

    def text(tok: Tokenizer, *args: Any) -> str:
        return tok.tok.decode(tok.chat_prompt(*args), skip_special_tokens=False)

    plain = text(chatml, turns, tools)  # (ChatML knows no tools: a system message shows them)
    assert plain.startswith("<|im_start|>system\nYou can call these tools:\n{\"name\": \"weather\"")
    assert '<|im_start|>assistant\n{"name": "weather", "arguments": {"city": "oslo"}}<|im_end|>' in plain
    assert plain.endswith("<|im_start|>system\nThe tool returned: sunny<|im_end|>\n"
                          "<|im_start|>assistant\n")
    strict = Tokenizer(dataclasses.replace(manifest, chat_template=STRICT))  # (Gemma's rule)
    assert text(strict, turns, tools).endswith(
        "user: weather in oslo?|assistant: {\"name\": \"weather\", \"arguments\": {\"city\": "
        "\"oslo\"}}|user: The tool returned: sunny|")
    assert text(chatml, turns, tools, "none").startswith("<|im_start|>user\nweather in oslo?")
    with pytest.raises(EdgeliteError, match="template refused these messages: roles must alternate"):
        strict.chat_prompt([turns[0], turns[0]])
    own = text(tagged, turns, tools, "required")
    assert own.startswith("<|im_start|>system\ntools: weather<|im_end|>")
    assert '<tool_call>\n{"arguments": {"city": "oslo"}, "name": "weather"}\n</tool_call>' in own
    assert "<tool_response>sunny</tool_response>" in own
    assert own.endswith("<|im_start|>assistant\n<tool_call>\n")  # (a forced call opens there)


@pytest.mark.e2e
def test_tool_calls_and_embeddings_through_both_doors(exported) -> None:
    """The `openai` package: forced and named calls follow the tools' schemas, streamed and
    not; a call's result goes back and the model answers; auto gives text or a valid call;
    embeddings are unit vectors of the hidden size, the same each time and the same as the
    library's; fields the server does not take are 400s naming them."""
    manifest = dataclasses.replace(load(exported["llama"]), chat_template=TAGGED)
    cfg = GatewayConfig(port=0)

    async def main() -> None:
        sched = Scheduler(SchedulerConfig(context_limit=manifest.max_positions, kv_tokens=4096))
        async with _doors(manifest, cfg, sched) as (_, backend, base, native):
            with openai.OpenAI(base_url=base + "/v1", api_key="t-u", max_retries=0) as api:

                def ask(**kw: Any) -> Any:
                    return asyncio.to_thread(lambda: api.chat.completions.create(
                        model=manifest.name, max_tokens=200, **kw))

                hi = [{"role": "user", "content": "what is the weather in paris"}]
                calls = []
                for seed, choice in enumerate(["required", "required", {"type": "function", "function": {
                        "name": "add"}}, "required"]):
                    out = await ask(messages=hi, tools=[WEATHER, ADD], tool_choice=choice,
                                    temperature=0.0 if seed == 0 else 1.0, seed=seed)
                    got = out.choices[0]
                    assert got.finish_reason == "tool_calls" and got.message.content is None, \
                        repr(got.message.content)
                    (call,) = got.message.tool_calls
                    parsed = {"name": call.function.name, "arguments": json.loads(call.function.arguments)}
                    assert _valid(parsed), parsed
                    assert isinstance(choice, str) or parsed["name"] == "add"
                    calls.append(call)
                stream = await asyncio.to_thread(lambda: list(api.chat.completions.create(
                    model=manifest.name, max_tokens=200, messages=hi, tools=[WEATHER, ADD],
                    tool_choice="required", stream=True, temperature=0.0, seed=0)))
                deltas = [c.choices[0] for c in stream if c.choices]
                (streamed,) = next(d.delta.tool_calls for d in deltas if d.delta.tool_calls)
                assert deltas[-1].finish_reason == "tool_calls"
                assert (streamed.function.name, streamed.function.arguments) == (
                    calls[0].function.name, calls[0].function.arguments)  # (greedy: the same call)
                back = [*hi, {"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
                        {"role": "tool", "tool_call_id": calls[0].id, "content": "rain, 12 C"}]
                answer = await ask(messages=back, tools=[WEATHER, ADD], tool_choice="none")
                assert answer.choices[0].finish_reason in ("stop", "length")
                assert answer.choices[0].message.tool_calls is None
                assert answer.usage.prompt_tokens > (await ask(messages=hi)).usage.prompt_tokens
                for seed in range(6):  # auto: text, or a call that follows the schema
                    got = (await ask(messages=hi, tools=[WEATHER, ADD], temperature=1.0,
                                     seed=seed)).choices[0]
                    if got.finish_reason == "tool_calls":
                        call = got.message.tool_calls[0].function
                        assert _valid({"name": call.name, "arguments": json.loads(call.arguments)})
                    else:
                        assert isinstance(got.message.content, str)
                # the native door: the same call, the same words for what is wrong
                reply = [p async for p in native.generate(hi, GenerationConfig(
                    max_tokens=200, tools=json.dumps([WEATHER, ADD]), tool_choice="required"))]
                assert native.last.finish == "tool_calls" and "".join(reply) == ""
                first = calls[0].function
                assert json.loads(native.last.tool_call) == {"name": first.name,
                                                              "arguments": json.loads(first.arguments)}
                for body, param, words in (
                        ({"tools": [WEATHER], "tool_choice": "sub"}, "tool_choice", "must be auto, none"),
                        ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
                        ({"tools": [{"function": {"name": "a b"}}]}, "tools", "name must be"),
                        ({"tools": [WEATHER], "response_format": {"type": "json_object"}},
                         "response_format", "do not go together"),
                        ({"logit_bias": {"1": 5}}, "logit_bias", "field 'logit_bias' is not supported"),
                        ({"functions": []}, "functions", "field 'functions'")):
                    status, out = await asyncio.to_thread(_post, base, {"messages": hi, **body})
                    assert status == 400 and out["error"]["param"] == param and words in \
                        out["error"]["message"], out
                # embeddings: base64 (the package's default) and plain numbers
                texts = ["the quick brown fox", "hello world", "the quick brown fox"]
                got = await asyncio.to_thread(lambda: api.embeddings.create(model=manifest.name, input=texts))
                vectors = [np.array(d.embedding) for d in got.data]
                assert [len(v) for v in vectors] == [manifest.hidden_size] * 3
                assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in vectors)
                assert np.array_equal(vectors[0], vectors[2]) and not np.allclose(vectors[0], vectors[1])
                mine = await embed(backend, Tokenizer(manifest).text_prompt(texts[0]), 4)
                assert np.allclose(mine, vectors[0], atol=1e-5)  # (chunks of 4, 64: the same states)
                floats = await asyncio.to_thread(lambda: api.embeddings.create(
                    model=manifest.name, input="hello world", encoding_format="float"))
                assert np.allclose(floats.data[0].embedding, vectors[1], atol=1e-6)
                assert got.usage.prompt_tokens == 2 * len(Tokenizer(manifest).text_prompt(texts[0])) + \
                    len(Tokenizer(manifest).text_prompt(texts[1]))
                for body, words in (({"input": []}, "input must be"), ({"input": [[1, 2]]}, "token ids"),
                                    ({"input": "x", "dimensions": 8}, "field 'dimensions'"),
                                    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
                                    ({"input": "x" * 600}, "tokens")):
                    with pytest.raises(openai.BadRequestError, match=words):
                        await asyncio.to_thread(lambda b=body: api.embeddings.create(
                            model=manifest.name, **b))
                raw = await asyncio.to_thread(lambda: api.embeddings.with_raw_response.create(
                    model=manifest.name, input="hello world"))
                sent = base64.b64decode(raw.http_response.json()["data"][0]["embedding"])
                assert np.allclose(np.frombuffer(sent, "<f4"), vectors[1])

    asyncio.run(main())


@pytest.mark.e2e
def test_a_template_that_refuses_the_messages_is_a_400(exported) -> None:
    """Messages a model's template raises on (Gemma's: turns must alternate) are the request's
    fault: a 400 in the template's words, and the gateway goes on."""
    manifest = dataclasses.replace(load(exported["llama"]), chat_template=STRICT)

    async def main() -> None:
        sched = Scheduler(SchedulerConfig(context_limit=manifest.max_positions, kv_tokens=4096))
        async with _doors(manifest, GatewayConfig(port=0), sched) as (_, _b, base, _c):
            hi = {"role": "user", "content": "hi"}
            status, out = await asyncio.to_thread(_post, base, {"messages": [hi, hi]})
            assert status == 400 and out["error"]["param"] == "messages", out
            assert "template refused these messages: roles must alternate" in out["error"]["message"]
            status, out = await asyncio.to_thread(_post, base, {"messages": [hi], "max_tokens": 3})
            assert status == 200, out

    asyncio.run(main())
