"""The reply driver (reply/driver.py) on its own: no model, no backend, logits made by hand."""

from __future__ import annotations

import numpy as np
import pytest

from edgelite.config import GenerationConfig
from edgelite.reply.driver import ReplyDriver
from edgelite.reply.embed import Pool
from edgelite.reply.loop import ReplyLoop
from edgelite.reply.speculate import Draft, Lookup, Pacer

pytestmark = pytest.mark.unit

VOCAB, EOS = 32, 31


def onehot(*tokens: int) -> np.ndarray:
    """Logits whose row i picks tokens[i] (one row: a vector)."""
    rows = np.full((len(tokens), VOCAB), -10.0, np.float32)
    rows[np.arange(len(tokens)), tokens] = 10.0
    return rows[0] if len(tokens) == 1 else rows


def driver(prompt: list[int], max_tokens: int = 8, draft_tokens: int = 0,
           lookup: bool = False) -> ReplyDriver:
    cfg = GenerationConfig(max_tokens=max_tokens, draft_tokens=draft_tokens)
    reply = ReplyLoop(cfg, [EOS], prompt=prompt)
    return ReplyDriver(reply, prompt, Lookup() if lookup else None, Pacer() if lookup else None)


def test_a_prompt_goes_in_chunks_and_only_the_last_gives_a_token() -> None:
    d = driver([1, 2, 3, 4, 5, 6, 7])
    calls = []
    while not d.tokens:
        call = d.next_call(chunk=3)
        calls.append((call.kind, call.ids, call.gives))
        out = d.took(call, onehot(9))
        assert (out.pieces != []) == call.gives
    assert calls == [("forward", [1, 2, 3], False), ("forward", [4, 5, 6], False), ("forward", [7], True)]
    assert d.fed == [1, 2, 3, 4, 5, 6, 7] and d.tokens == [9]
    call = d.next_call(chunk=3)  # then one token a step
    assert (call.kind, call.ids, call.gives) == ("forward", [9], True)


def test_an_imported_prefix_is_not_computed_again_unless_it_is_unusable() -> None:
    d = driver([1, 2, 3, 4, 5])
    assert d.wanted() == [1, 2, 3, 4]  # (the last id's logits must be computed)
    d.imported(3)
    assert d.fed == [1, 2, 3] and d.restored == 3 and d.reply.stats.reused_tokens == 3
    assert d.next_call().ids == [4, 5]
    assert d.unusable() == 3  # the first step failed on the imported KV: all of it again
    assert d.fed == [] and d.reply.stats.reused_tokens == 0
    call = d.next_call()
    assert call.ids == [1, 2, 3, 4, 5]
    d.took(call, onehot(8))
    assert d.restored == 0 and d.tokens == [8]


def test_a_preempted_reply_feeds_its_prompt_and_tokens_again() -> None:
    d = driver([1, 2, 3], max_tokens=8)
    for token in (5, 6):
        d.took(d.next_call(), onehot(token))
    assert d.fed == [1, 2, 3, 5] and d.tokens == [5, 6]
    d.reset()
    assert d.fed == [] and d.wanted() == [1, 2, 3, 5]
    call = d.next_call(chunk=16)
    assert call.ids == [1, 2, 3, 5, 6] and call.gives


def test_drafts_are_verified_and_the_refused_positions_given_back() -> None:
    d = driver([4, 5, 6, 7, 4, 5], max_tokens=12, draft_tokens=2, lookup=True)
    d.took(d.next_call(), onehot(6))  # the reply goes 6: the lookup has seen 4 5 6 -> 7 4
    call = d.next_call()
    assert call.kind == "verify" and call.ids == [6, 7, 4] and call.drafts.tokens == [7, 4]
    out = d.took(call, onehot(7, 9, 1))  # 7 taken, 4 refused (the model says 9)
    assert out.accepted == 1 and [p.token_id for p in out.pieces] == [7, 9]
    assert d.fed == [4, 5, 6, 7, 4, 5, 6, 7] and out.rollback == len(d.fed)
    assert d.tokens == [6, 7, 9]


def test_all_drafts_taken_need_no_rollback_and_a_reply_ended_in_them_none() -> None:
    d = driver([4, 5, 6, 7, 4, 5], max_tokens=12, draft_tokens=2, lookup=True)
    d.took(d.next_call(), onehot(6))
    out = d.took(d.next_call(), onehot(7, 4, 3))
    assert out.accepted == 2 and out.rollback is None and d.tokens == [6, 7, 4, 3]
    e = driver([4, 5, 6, 7, 4, 5], max_tokens=12, draft_tokens=2, lookup=True)
    e.took(e.next_call(), onehot(6))
    out = e.took(e.next_call(), onehot(EOS, 4, 3))  # the reply ends at the first position
    assert e.done and out.rollback is None


def test_a_draft_models_drafts_and_how_many_it_is_asked_for() -> None:
    d = driver([1, 2, 3], max_tokens=4, draft_tokens=3)
    assert d.draft_count(1.0) == 0  # no pacer: no speculation
    d = ReplyDriver(ReplyLoop(GenerationConfig(max_tokens=4, draft_tokens=3), [EOS]), [1, 2, 3],
                    pacer=Pacer())
    assert d.draft_count(1.0) == 0  # the prompt first
    d.took(d.next_call(), onehot(5))
    assert d.draft_count(1.0) == 2  # 3 asked, but 4 tokens at most: 2 may follow the next
    call = d.next_call(draft=Draft([8, 9]))
    assert call.kind == "verify" and call.ids == [5, 8, 9]


def test_an_embedding_runs_its_chunks_as_hidden_steps() -> None:
    pool = Pool(4)
    d = ReplyDriver(None, [1, 2, 3, 4, 5], pool=pool)
    sizes = []
    while not d.done:
        call = d.next_call(chunk=2)
        assert call.kind == "hidden" and not call.gives
        sizes.append(len(call.ids))
        d.took(call, np.ones((len(call.ids), 4), np.float32))
    assert sizes == [2, 2, 1] and pool.count == 5
    d.reset()
    assert pool.count == 0 and not d.done


def test_a_driver_is_a_replys_or_an_embeddings() -> None:
    with pytest.raises(ValueError):
        ReplyDriver(None, [1, 2])
