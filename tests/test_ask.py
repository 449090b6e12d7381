"""The gateway's request rules (serve/ask.py) on their own: each broken rule is an AskError
naming its field, and the defaults fill only what a request leaves out."""

from __future__ import annotations

import json

import pytest

from edgelite.config import GatewayConfig, GenerationConfig
from edgelite.serve.ask import Ask, AskError, check, generation

pytestmark = pytest.mark.unit

CFG = GatewayConfig()


def chat(content: str = "hi", **kw: object) -> Ask:
    return Ask(messages=[{"role": "user", "content": content}], **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("ask", "param", "says"), [
    (Ask(), "messages", "messages [{role, content}] or a prompt"),
    (Ask(messages=[{"role": "user", "content": "a"}], text="b"), "messages", "not both"),
    (Ask(messages=[]), "messages", "non-empty"),
    (Ask(messages=[{"role": "robot", "content": "a"}]), "messages", "messages[0].role"),
    (chat("x" * (CFG.max_prompt_chars + 1)), "messages", "max_prompt_chars"),
    (Ask(text="x" * (CFG.max_prompt_chars + 1)), "prompt", "max_prompt_chars"),
    (chat(max_tokens=0), "max_tokens", "max_tokens"),
    (chat(max_tokens=CFG.max_tokens_limit + 1), "max_tokens", "max_tokens"),
    (chat(temperature=-0.1), "temperature", "temperature"),
    (chat(top_p=1.5), "top_p", "top_p"),
    (chat(min_p=-1.0), "min_p", "min_p"),
    (chat(presence_penalty=3.0), "presence_penalty", "presence_penalty"),
    (chat(repetition_penalty=0.0), "repetition_penalty", "repetition_penalty"),
    (chat(logprobs=CFG.max_top_logprobs + 1), "top_logprobs", "top_logprobs"),
    (chat(response_format="yaml"), "response_format", "text, json_object or json_schema"),
    (chat(response_format="json_schema", json_schema="{"), "response_format", "json_schema"),
    (chat(speculate="draft"), "speculate", "prompt lookup only"),
    (chat(stop=("",)), "stop", "non-empty"),
    (chat(stop=tuple("abcdefghijklmnop")[:CFG.max_stops + 1]), "stop", f"up to {CFG.max_stops}"),
    (Ask(messages=[{"role": "user", "content": "a"}], embedding=True), "input", "of a text"),
])
def test_each_broken_rule_names_its_field(ask: Ask, param: str, says: str) -> None:
    with pytest.raises(AskError, match=None) as caught:
        check(ask, CFG)
    assert caught.value.param == param and says in str(caught.value), str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_request_within_every_rule_passes_and_keeps_its_own_settings() -> None:
    ask = chat(max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=("END",), top_k=5,
               logprobs=2, response_format="json_schema",
               json_schema=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    check(ask, CFG)
    got = generation(ask, GenerationConfig(max_tokens=100, temperature=1.0, top_k=40))
    assert (got.max_tokens, got.temperature, got.top_p, got.seed, got.top_k) == (7, 0.5, 0.9, 3, 5)
    assert got.stop == ("END",) and got.logprobs == 2


def test_the_defaults_fill_only_what_a_request_leaves_out() -> None:
    defaults = GenerationConfig(max_tokens=100, temperature=0.7, top_p=0.8, top_k=40)
    got = generation(chat(), defaults)
    assert (got.max_tokens, got.temperature, got.top_p, got.top_k) == (100, 0.7, 0.8, 40)
    assert generation(chat(temperature=0.0), defaults).temperature == 0.0  # (0 is a value, not absent)


def test_tool_calls_in_the_history_are_checked() -> None:
    good = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": json.dumps([{"name": "w", "arguments": {}}])}]
    check(Ask(messages=good), CFG)
    bad = [good[0], {"role": "assistant", "content": "", "tool_calls": "not json"}]
    with pytest.raises(AskError) as caught:
        check(Ask(messages=bad), CFG)
    assert caught.value.param == "messages" and "messages[1]" in str(caught.value)


def test_every_text_a_request_carries_counts_and_malformed_unicode_is_refused() -> None:
    small = GatewayConfig(max_prompt_chars=100)
    tools = json.dumps([{"type": "function", "function": {"name": "w", "description": "x" * 200,
                                                          "parameters": {"type": "object"}}}])
    with pytest.raises(AskError, match="max_prompt_chars"):
        check(chat("hi", tools=tools), small)  # (the tools' text counts)
    calls = json.dumps([{"name": "w", "arguments": {"a": "y" * 200}}])
    with pytest.raises(AskError, match="max_prompt_chars"):
        check(Ask(messages=[{"role": "user", "content": "a"},
                            {"role": "assistant", "content": "", "tool_calls": calls}]), small)
    check(chat("\U0001F600" * 25), small)  # 25 characters beyond the BMP count as 100
    with pytest.raises(AskError, match="max_prompt_chars"):
        check(chat("\U0001F600" * 26), small)
    with pytest.raises(AskError, match="malformed Unicode") as caught:
        check(chat("a\ud800b"), CFG)
    assert caught.value.param == "messages"


def test_a_schema_or_tools_past_the_size_cap_is_refused_up_front() -> None:
    """Each candidate token of a constrained reply is weighed against every enum value,
    property and branch: a 3,000-value enum or a wide anyOf is refused before any work."""
    small = GatewayConfig(max_schema_values=64)
    wide = {"type": "object", "properties": {"a": {"enum": [f"v{i}" for i in range(3000)]}}}
    with pytest.raises(AskError, match="3001 enum values, properties and anyOf branches") as caught:
        check(chat(response_format="json_schema", json_schema=json.dumps(wide)), CFG)
    assert caught.value.param == "response_format"
    branches = {"type": "object", "properties": {"a": {"anyOf": [{"type": "integer"}] * 70}}}
    with pytest.raises(AskError, match="max_schema_values"):
        check(chat(response_format="json_schema", json_schema=json.dumps(branches)), small)
    tools = json.dumps([{"type": "function", "function": {"name": f"t{i}", "parameters": {
        "type": "object", "properties": {"x": {"enum": list(range(10))}}}}} for i in range(8)])
    with pytest.raises(AskError, match="max_schema_values") as caught:
        check(chat(tools=tools), small)
    assert caught.value.param == "tools"
    check(chat(tools=tools), CFG)  # (within the default)
