"""The engine on tiny models: chunked prompts, in-place KV, batched decode over slots, bounded
shapes, memory handed back."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from edgelite import manifest as mf
from edgelite.config import RuntimeConfig
from edgelite.engine.layers import LayerRange, export_files
from edgelite.engine.runtime import LocalChain

CFG = RuntimeConfig(threads=1, prefill_chunks=(4, 16), kv_buckets=(32, 64, 128, 256),
                    kv_slab_slots=4)
BATCHING = replace(CFG, invariant=False)  # (batches of decode steps: engine/passes/invariant.py)


def _layers(model: Path, cfg: RuntimeConfig = CFG) -> LayerRange:
    m = mf.load(model)
    return LayerRange(m, 0, m.num_layers - 1, cfg, export_files(m))


@pytest.mark.engine
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_chunked_prompt_equals_one_pass(exported, arch: str) -> None:
    """A prompt of 23 tokens in chunks of 16 + 4 + 4 (the last padded from 3) gives the same
    outputs and the same next step as one 32-token chunk."""
    rng = np.random.default_rng(0)
    m = mf.load(exported[arch])
    x = rng.standard_normal((1, 23, m.hidden_size)).astype(np.float32)
    tok = rng.standard_normal((1, 1, m.hidden_size)).astype(np.float32)
    one = _layers(exported[arch], RuntimeConfig(threads=1, prefill_chunks=(32,)))
    s = one.pool.acquire()
    whole, after_whole = one.run(s, x), one.run(s, tok)
    chunked = _layers(exported[arch])
    s = chunked.pool.acquire()
    parts = [chunked.run(s, x[:, a:b]) for a, b in ((0, 16), (16, 20), (20, 23))]
    np.testing.assert_allclose(np.concatenate(parts, 1), whole, atol=2e-5, rtol=0)
    np.testing.assert_allclose(chunked.run(s, tok), after_whole, atol=2e-5, rtol=0)
    assert s.length == 24 and np.isfinite(whole).all()


@pytest.mark.engine
def test_a_range_in_several_sessions_equals_one(exported) -> None:
    """Layers split over sessions by weight bytes (here one a session) give the same prompt
    outputs, decode steps (bytes lane included) and batches as one session of them all."""
    rng = np.random.default_rng(2)
    m = mf.load(exported["llama"])
    assert m.num_layers > 1
    x = rng.standard_normal((1, 7, m.hidden_size)).astype(np.float32)
    tok = rng.standard_normal((1, 1, m.hidden_size)).astype(np.float32)
    outs = []
    for weights_mb in (1 << 20, 0):
        lr = _layers(exported["llama"], replace(BATCHING, session_weights_mb=weights_mb))
        assert len(lr.sessions) == (1 if weights_mb else m.num_layers)
        s = lr.pool.acquire()
        prompt, step = lr.run(s, x), lr.run(s, tok)
        raw = np.frombuffer(lr.decode_bytes(s, memoryview(tok.tobytes())), np.float32).copy()
        outs.append((prompt, step, raw, lr.run_batch([s], tok)))
    for a, b in zip(*outs, strict=True):
        np.testing.assert_allclose(a.reshape(-1), b.reshape(-1), atol=2e-5, rtol=0)


@pytest.mark.engine
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_batched_decode_equals_each_session_alone(exported, arch: str) -> None:
    """Sessions of different lengths in slots 0, 1 and 3 of one slab (slot 2 holds a session
    that does not step) decode together; each equals its solo run, KV included."""
    rng = np.random.default_rng(1)
    m = mf.load(exported[arch])
    lengths = [5, 1, 9, 3]
    prompts = [rng.standard_normal((1, n, m.hidden_size)).astype(np.float32) for n in lengths]
    steps = rng.standard_normal((4, 1, m.hidden_size)).astype(np.float32)
    solo = _layers(exported[arch], BATCHING)
    want = []
    for p, t in zip(prompts, steps, strict=True):
        s = solo.pool.acquire()
        solo.run(s, p)
        want.append((solo.run(s, t[None]), solo.run(s, t[None])))
        solo.pool.release(s)
    batch = _layers(exported[arch], BATCHING)
    slots = [batch.pool.acquire() for _ in lengths]
    for s, p in zip(slots, prompts, strict=True):
        batch.run(s, p)
    stepping = [slots[0], slots[1], slots[3]]
    rows = steps[[0, 1, 3]]
    first, second = batch.run_batch(stepping, rows), batch.run_batch(stepping, rows)
    for i, k in enumerate((0, 1, 3)):
        np.testing.assert_allclose(first[i], want[k][0][0], atol=2e-5, rtol=0)
        np.testing.assert_allclose(second[i], want[k][1][0], atol=2e-5, rtol=0)
    assert [s.length for s in slots] == [7, 3, 9, 5]  # the idle session did not move
    # and the idle one still continues exactly as alone
    np.testing.assert_allclose(batch.run(slots[2], steps[2:3]), want[2][0], atol=2e-5, rtol=0)


@pytest.mark.engine
def test_shapes_stay_bounded_and_memory_goes_back(tmp_path: Path) -> None:
    """A 1,000-token conversation (prompts and replies of every length) runs at no more than
    |chunks| + 1 distinct shapes per layer session; its KV pages go back when it ends."""
    import models
    from edgelite_export import build

    hf = models.build("qwen2", tmp_path / "hf", max_position_embeddings=2048)
    model = build.run(str(hf), tmp_path / "m", build.Options(steps=4)).out
    cfg = RuntimeConfig(threads=1, prefill_chunks=(16, 64, 256),
                        kv_buckets=(128, 256, 512, 1024, 2048))
    chain = LocalChain(mf.load(model), cfg)
    rng = np.random.default_rng(2)
    total = 0
    for _ in range(12):  # user prompt, then a reply of single tokens
        n = int(rng.integers(5, 120))
        chain.forward("chat", rng.integers(0, 300, (1, n)))
        for _ in range(int(rng.integers(3, 40))):
            chain.forward("chat", rng.integers(0, 300, (1, 1)))
        total = chain.length("chat")
        if total >= 1000:
            break
    assert total >= 1000, total
    shapes = {k[3] for k in chain.layers.bindings}  # (slab, lo, hi, chunk): one row each
    assert len(chain.layers.bindings) <= len(cfg.prefill_chunks) + len(cfg.kv_buckets) + 1
    assert shapes <= {1, 16, 64, 256}
    pool = chain.layers.pool
    assert pool.bucket(total) == min(b for b in cfg.kv_buckets if b >= total) and pool.sessions == 1
    chain.end("chat")
    assert pool.sessions == 0



@pytest.mark.unit
def test_prompt_cut_runs_fewest_padded_tokens() -> None:
    """chunks_of covers the prompt in order with chunks no longer than the largest size, and
    no other cut of its tail (whole chunks or single tokens, then one padded chunk) runs fewer
    padded tokens + overhead per chunk."""
    import itertools

    from edgelite.engine.runtime import _pad, chunks_of

    sizes = (16, 64, 256)

    def cost(cut: list[int]) -> int:
        return sum(_pad(k, sizes) + 4 for k in cut)

    for n in range(1, 700):
        bounds = list(chunks_of(n, sizes, 4))
        ends = [a for a, _ in bounds[1:]] + [n]
        assert bounds[0][0] == 0 and all(a < b <= a + 256 for a, b in bounds)
        assert [b for _, b in bounds] == ends
        rest = n - 256 * ((n - 1) // 256)  # what is left after the leading full chunks
        cut = [b - a for a, b in bounds][(n - 1) // 256:]
        assert cut == sorted(cut, reverse=True)  # the shortest steps last
        best = min(cost([*c, rest - sum(c)])
                   for r in range(8) for c in itertools.combinations_with_replacement((1, *sizes), r)
                   if 0 < rest - sum(c))
        assert cost(cut) <= best, (n, cut)
    assert [b - a for a, b in chunks_of(35, sizes, 4)] == [16, 16, 1, 1, 1]  # not 3 padded to 16
    assert [b - a for a, b in chunks_of(18, (4, *sizes), 4)] == [16, 2]  # 2 padded to 4
    assert [b - a for a, b in chunks_of(18, sizes, 4)] == [16, 1, 1]  # not 16 + 2 padded to 16


@pytest.mark.unit
def test_a_pipelines_prompt_is_cut_into_the_chunks_that_keep_its_stages_busy() -> None:
    """Through P stages, chunks taking c_1..c_k each are done after sum(c) + (P - 1) max(c):
    chunks_of picks the cap size (none below min_cap) whose cut gives the least of that, and
    one stage cuts as before (the largest size)."""
    from edgelite.engine.runtime import _pad, chunks_of

    sizes = (4, 16, 64, 256)

    def cut(n: int, stages: int, min_cap: int = 16) -> list[int]:
        return [b - a for a, b in chunks_of(n, sizes, 4, stages, min_cap)]

    def cost(c: list[int], stages: int) -> int:
        each = [_pad(k, sizes) + 4 for k in c]
        return sum(each) + (stages - 1) * max(each)

    def capped(n: int, cap: int) -> list[int]:  # one stage's cut with sizes up to cap
        return [b - a for a, b in chunks_of(n, sizes[:sizes.index(cap) + 1], 4)]

    for n in range(1, 600):
        assert cut(n, 1) == cut(n, 1, 0) == capped(n, 256)
        for stages in (2, 3, 5):
            got = cut(n, stages)
            assert sum(got) == n and max(got) <= 256 and got[-1] == min(got)
            for cap in (16, 64, 256):  # no other allowed cap does better
                assert cost(got, stages) <= cost(capped(n, cap), stages), (n, stages, cap)
    assert cut(1015, 1) == [256, 256, 256, 247] and cut(1015, 3) == [64] * 15 + [55]
    assert cut(300, 3) == [16] * 18 + [12]
    assert cut(18, 3) == [16, 2] and cut(18, 3, 4) == [4, 4, 4, 4, 2]  # the floor holds
