"""The public API (`import edgelite`) on a tiny model, in this process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import edgelite


def _chat(model: Path, **kw) -> tuple[str, list[int], str]:
    async def main() -> tuple[str, list[int], str]:
        async with edgelite.connect(model) as llm:
            assert llm.plan is not None and llm.plan.local is not None and not llm.plan.remote
            reply = llm.chat([{"role": "user", "content": "hello world"}], **kw)
            pieces = [p async for p in reply]
            assert "".join(p.text for p in pieces) == reply.text
            return reply.text, reply.token_ids, reply.stats.finish

    return asyncio.run(main())


@pytest.mark.engine
def test_connect_locally_and_chat(exported) -> None:
    text, ids, finish = _chat(exported["llama"], max_tokens=12)
    assert len(ids) == 12 and finish == "length" and text


@pytest.mark.engine
def test_stop_strings_end_the_reply_before_them(exported) -> None:
    model = exported["llama"]
    text, _, _ = _chat(model, max_tokens=24)
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    cut, _, finish = _chat(model, max_tokens=24, stop=[stop])
    assert finish == "stop" and cut == text[: text.index(stop)]


@pytest.mark.engine
def test_a_seed_makes_sampling_repeatable(exported) -> None:
    model = exported["llama"]
    a = _chat(model, max_tokens=16, temperature=1.5, seed=7)[1]
    b = _chat(model, max_tokens=16, temperature=1.5, seed=7)[1]
    c = _chat(model, max_tokens=16, temperature=1.5, seed=8)[1]
    assert a == b and a != c


@pytest.mark.unit
def test_the_public_names_load_on_use() -> None:
    assert set(edgelite.__all__) == set(edgelite._EXPORTS)
    for name in edgelite.__all__:
        assert getattr(edgelite, name) is not None
    with pytest.raises(AttributeError):
        edgelite.nothing_like_this  # noqa: B018
