"""Decode steps of several sessions as one batch stay bit-identical to each session alone where
the attention and the products are edgelite's (issue 65: the invariant default used to run a
node's decode steps one session at a time): a range's run_batch against the same sessions
stepped one by one, on SmolLM2's fast int4 export and the tiny Llama."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgelite import manifest as mf
from edgelite.config import RuntimeConfig
from edgelite.engine.layers import LayerRange, export_files
from edgelite.errors import EdgeliteError

pytestmark = pytest.mark.engine


def _check(model: Path) -> None:
    m = mf.load(model)
    cfg = RuntimeConfig(threads=1)
    batched, alone = (LayerRange(m, 0, m.num_layers - 1, cfg, export_files(m)) for _ in range(2))
    if not batched.batchable:
        pytest.skip("this CPU runs the export's products in onnxruntime: steps are not batched")
    rng = np.random.default_rng(7)
    h = m.hidden_size
    prompts = [rng.standard_normal((1, n, h)).astype(np.float32) for n in (5, 17, 9)]
    slots_b = [batched.pool.acquire() for _ in prompts]
    slots_a = [alone.pool.acquire() for _ in prompts]
    for p, sb, sa in zip(prompts, slots_b, slots_a, strict=True):
        assert np.array_equal(batched.run(sb, p), alone.run(sa, p))
    for _ in range(3):
        step = rng.standard_normal((len(prompts), 1, h)).astype(np.float32)
        together = batched.run_batch(slots_b, step)
        for i, sa in enumerate(slots_a):
            assert np.array_equal(together[i], alone.run(sa, step[i:i + 1])[0]), i
    assert [s.length for s in slots_b] == [s.length for s in slots_a]


def test_a_batch_of_sessions_gives_each_sessions_own_bits(smollm2_int4: Path) -> None:
    _check(smollm2_int4)


def test_a_batch_of_the_tiny_llama_gives_each_sessions_own_bits(exported) -> None:
    _check(exported["llama"])


def test_a_range_with_onnxruntimes_attention_steps_one_session_at_a_time(exported) -> None:
    """Invariant, with onnxruntime's attention (no kernel), a range would compute a batch's
    rows otherwise than alone: it refuses a batch (the node then steps one session at a time,
    and its stats say batched_decode false); --no-invariant batches anyway."""
    m = mf.load(exported["llama"])
    for invariant, batchable in ((True, False), (False, True)):
        cfg = RuntimeConfig(threads=1, attention_kernel=False, invariant=invariant)
        layers = LayerRange(m, 0, m.num_layers - 1, cfg, export_files(m))
        assert layers.batchable is batchable
        slots = [layers.pool.acquire() for _ in range(2)]
        for slot in slots:
            layers.run(slot, np.ones((1, 2, m.hidden_size), np.float32))
        step = np.ones((2, 1, m.hidden_size), np.float32)
        if batchable:
            assert layers.run_batch(slots, step).shape == (2, 1, m.hidden_size)
        else:
            with pytest.raises(EdgeliteError, match="one session at a time"):
                layers.run_batch(slots, step)
        layers.close()
