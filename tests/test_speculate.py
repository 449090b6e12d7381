"""Speculative decoding (reply/speculate.py): drafts verified in one step give the ids the
model gives without them (greedy, locally and on 3 node processes, with rollbacks on every
stage), and, sampled, the same distribution (chi-square on real logits of a tiny model)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest

from edgelite import manifest as mf
from edgelite.cli.localnodes import TOKEN
from edgelite.client.llm import open_llm
from edgelite.client.local import LocalBackend
from edgelite.config import MAX_ROLLBACK, GenerationConfig, RuntimeConfig
from edgelite.engine.runtime import LocalChain
from edgelite.reply.generate import generate
from edgelite.reply.loop import ReplyLoop, Stats
from edgelite.reply.sampling import distribution
from edgelite.reply.speculate import DraftModel, Lookup, Pacer, Speculation


def _prompts(n: int, vocab: int) -> list[list[int]]:
    """Prompts with repeats in them (prompt lookup finds something) and without."""
    rng = np.random.default_rng(7)
    out = []
    for i in range(n):
        base = rng.integers(5, vocab, 6 + i % 5).tolist()
        out.append(base * 3 if i % 2 else base + rng.integers(5, vocab, 4).tolist())
    return out


async def _ids(backend, prompt: list[int], cfg: GenerationConfig,
               spec: Speculation | None = None, stats: Stats | None = None) -> list[int]:
    return [p.token_id async for p in generate(backend, prompt, cfg, stats, reuse=False,
                                               speculation=spec) if p.token_id is not None]


@pytest.mark.unit
def test_lookup_proposes_what_followed_the_latest_occurrence() -> None:
    look = Lookup(max_ngram=3)
    assert look.propose([1, 2, 3, 4], 3).tokens == []  # nothing seen twice
    assert look.propose([1, 2, 3, 4, 1, 2], 3).tokens == [3, 4, 1]
    assert look.propose([1, 2, 3, 4, 1, 2, 9, 2], 2).tokens == [9, 2]  # latest "2": followed by 9
    assert look.propose([1, 2, 3, 4, 1, 2, 9, 2, 3], 4).tokens == [4, 1, 2, 9]  # "2 3" wins


@pytest.mark.unit
def test_pacer_speculates_only_where_it_pays() -> None:
    slow_link = Pacer(step_ms=40.0, compute_ms=4.0)  # links take most of a step
    loopback = Pacer(step_ms=10.0, compute_ms=10.0)
    for _ in range(20):  # drafts right 9 times in 10
        slow_link.observe(3, 3, 41.0)
        slow_link.observe(15, 10, 48.0)
    assert slow_link.k() == 15
    for _ in range(30):  # drafts rarely right
        loopback.observe(3, 0, 14.0)
    assert loopback.k() == 0


@pytest.mark.unit
def test_pacer_counts_only_the_drafts_at_hand() -> None:
    """A lookup that found one token cannot fill a 4-position step: its gain is one draft's,
    against the wider step's whole cost."""
    pacer = Pacer(step_ms=10.0, compute_ms=10.0)
    for _ in range(30):  # drafts right 2 times in 3; a 4-position step costs 1.74 plain ones
        pacer.observe(0, 0, 10.0)
        pacer.observe(3, 2, 17.4)
        pacer.observe(15, 2, 40.0)
    assert pacer.k() == 3  # three drafts at hand: they pay
    assert pacer.k(most=3) == 3
    assert pacer.k(most=1) == 0  # one: it does not


@pytest.mark.engine
@pytest.mark.parametrize("mode", ["lookup", "lookup-3", "draft"])
def test_greedy_ids_are_the_same_with_speculation_locally(exported, mode: str) -> None:
    m = mf.load(exported["llama"])
    prompts = _prompts(20, m.vocab_size)

    async def main() -> None:
        backend = LocalBackend(m)
        draft = DraftModel(LocalBackend(m)) if mode == "draft" else None
        cfg = GenerationConfig(max_tokens=24, draft_tokens=3 if mode == "lookup-3" else 0)
        spec = Speculation(Pacer(step_ms=10.0, compute_ms=1.0), draft)  # (a prior that speculates)
        offered = accepted = 0
        try:
            for prompt in prompts:
                want = await _ids(backend, prompt, GenerationConfig(max_tokens=24))
                stats = Stats()
                got = await _ids(backend, prompt, cfg, spec, stats)
                assert got == want, (prompt, got, want)
                offered, accepted = offered + stats.drafted, accepted + stats.accepted
        finally:
            await backend.close()
            if draft is not None:
                await draft.close()
        assert offered > 0 and 0 < accepted <= offered
        if mode == "draft":  # the model drafting for itself: every draft is right
            assert accepted == offered

    asyncio.run(main())


@pytest.mark.e2e
def test_greedy_ids_are_the_same_with_speculation_on_3_nodes(exported, node_factory) -> None:
    """Rejected drafts are rolled back on the client's layer and every node stage by the next
    step's start; the ids equal the local engine's without speculation."""
    model = exported["llama"]
    m = mf.load(model)
    nodes = [node_factory() for _ in range(3)]
    prompts = _prompts(20, m.vocab_size)

    async def main() -> None:
        local = LocalBackend(m)
        try:
            want = [await _ids(local, p, GenerationConfig(max_tokens=24)) for p in prompts]
        finally:
            await local.close()
        cfg = GenerationConfig(max_tokens=24, speculate="lookup", draft_tokens=3)
        async with await open_llm(model, [n.addr for n in nodes], TOKEN,
                                  split=[(0, 0), (1, 1), (2, 2)], generation=cfg) as llm:
            offered = accepted = 0
            for prompt, w in zip(prompts, want, strict=True):
                reply = llm.complete(prompt, reuse=False)
                await reply.collect()
                assert reply.token_ids == w, prompt
                offered += reply.stats.drafted
                accepted += reply.stats.accepted
            assert 0 < accepted < offered  # drafts taken, and some given back
            stats = await llm.node_stats()
            assert all(s["bad_frames"] == 0 for s in stats.values()), stats

    asyncio.run(main())


def _p_value(a: np.ndarray, b: np.ndarray) -> float:
    """Two samples' counts per category: chi-square test of one distribution (categories
    with fewer than 10 expected in all pooled into one), p by Wilson-Hilferty."""
    total = a + b
    keep = total >= 20
    a = np.append(a[keep], a[~keep].sum())
    b = np.append(b[keep], b[~keep].sum())
    total = a + b
    a, b, total = a[total > 0], b[total > 0], total[total > 0]
    ea, eb = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    x = float(((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum())
    k = len(total) - 1
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.engine
def test_sampled_tokens_keep_the_models_distribution(exported) -> None:
    """At temperature 1 on a tiny model's own logits: the token at a verified position, over
    4,000 seeded replies each, drawn plainly and through verification of a draft chosen
    outright (prompt lookup) or drawn from another distribution (a draft model's): the
    frequencies agree (chi-square, p > 0.01), and a wrong rule (always accepting) is caught."""
    m = mf.load(exported["llama"])
    chain = LocalChain(m, RuntimeConfig(threads=1))
    logits = chain.logits_all("s", np.array([[5, 9, 11, 5, 9]], np.int64))[-2:]  # two positions
    chain.end("s")
    cfg = GenerationConfig(max_tokens=4, temperature=1.0)
    p0 = distribution(logits[0], 1.0, 1.0)
    draft = int(np.argsort(-p0)[1])  # a likely token, not the likeliest
    q = distribution(logits[0] * 0.5 + 1.0, 1.0, 1.0)  # another model's view
    n = 4000

    def first(fn) -> np.ndarray:
        counts = np.zeros(m.vocab_size, np.int64)
        for seed in range(n):
            counts[fn(ReplyLoop(GenerationConfig(**{**cfg.__dict__, "seed": seed}), []))] += 1
        return counts

    plain = first(lambda r: r.next(logits[0]).token_id)
    looked = first(lambda r: r.verify(logits, [draft])[0][0].token_id)
    drawn = first(lambda r: r.verify(logits, [int(r.rng.choice(len(q), p=q))], [q])[0][0].token_id)
    assert _p_value(plain, looked) > 0.01
    assert _p_value(plain, drawn) > 0.01
    wrong = plain.copy()
    wrong[draft] += n // 4  # (a rule that accepts the draft too often)
    assert _p_value(plain, wrong) < 0.01


@pytest.mark.engine
def test_a_stage_rolls_back_only_a_few_positions(exported) -> None:
    m = mf.load(exported["llama"])
    chain = LocalChain(m, RuntimeConfig(threads=1))
    chain.forward("s", np.arange(5, 45, dtype=np.int64)[None])
    chain.rollback("s", 40 - MAX_ROLLBACK)
    assert chain.length("s") == 40 - MAX_ROLLBACK
    with pytest.raises(Exception, match="may go back to"):
        chain.rollback("s", 0)
    chain.end("s")


@pytest.mark.engine
def test_speculate_draft_refuses_another_tokenizer(exported, tmp_path: Path) -> None:
    """A draft whose tokenizer maps text to other ids (here: two vocabulary entries
    swapped) is refused when the model is connected, naming the draft."""
    import json
    import shutil

    from edgelite.errors import EdgeliteError

    other = tmp_path / "other"
    shutil.copytree(exported["llama"], other)
    m = mf.load(other)
    path = other / m.tokenizer
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(tok))

    async def main() -> None:
        with pytest.raises(EdgeliteError, match="another tokenizer"):
            await open_llm(exported["llama"], draft=other)
        llm = await open_llm(exported["llama"], draft=exported["llama"])  # the same: taken
        await llm.close()

    asyncio.run(main())
