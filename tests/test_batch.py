"""Decode steps of several sessions as one batch: left-padded KV with masks, on a real node."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from edgelite import manifest as mf
from edgelite.config import RuntimeConfig
from edgelite.engine.batch import run_batch
from edgelite.engine.runtime import LayerRange, positions_for
from edgelite.net import messages as msgs
from edgelite.net.frames import pack
from test_distributed import _cluster
from test_node_bad_input import _authed, _data

pytestmark = pytest.mark.e2e


def _solo(layers: LayerRange, prompt: np.ndarray, step: np.ndarray):
    """Prefill then one decode step on its own: (decode output, KV after it)."""
    kv = layers.new_cache()
    pos, mask = positions_for(0, prompt.shape[1])
    _, kv = layers.run(prompt, kv, pos, mask)
    pos, mask = positions_for(prompt.shape[1], 1)
    out, kv = layers.run(step, kv, pos, mask)
    return out, kv


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_batched_decode_equals_each_session_alone(exported, arch: str) -> None:
    m = mf.load(exported[arch])
    layers = LayerRange(m, 0, m.num_layers - 1, RuntimeConfig(threads=1))
    rng = np.random.default_rng(1)
    lengths = [5, 1, 3, 8]  # ragged: every session but the longest is padded
    prompts = [rng.standard_normal((1, n, m.hidden_size)).astype(np.float32) for n in lengths]
    steps = [rng.standard_normal((1, 1, m.hidden_size)).astype(np.float32) for _ in lengths]
    kvs = []
    for p in prompts:
        pos, mask = positions_for(0, p.shape[1])
        kvs.append(layers.run(p, layers.new_cache(), pos, mask)[1])
    outs, grown = run_batch(layers, steps, kvs, lengths)
    for i, (p, s) in enumerate(zip(prompts, steps, strict=True)):
        want, want_kv = _solo(layers, p, s)
        np.testing.assert_allclose(outs[i], want, atol=1e-5, rtol=0)
        assert grown[i].length == lengths[i] + 1
        for a, b in zip(grown[i].keys + grown[i].values, want_kv.keys + want_kv.values, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def _frame(plan: str, session: str, step: int, start: int, hidden: np.ndarray) -> bytes:
    return pack(msgs.Forward(plan_id=plan, session=session, step=step, start=start, hidden=hidden))


def test_node_batches_steps_that_arrive_together(exported, node_factory) -> None:
    model = exported["llama"]
    m = mf.load(model)
    node = node_factory()
    layers = LayerRange(m, 0, m.num_layers - 1, RuntimeConfig(threads=1))
    rng = np.random.default_rng(2)
    lengths = [2, 6, 4, 1]
    prompts = [rng.standard_normal((1, n, m.hidden_size)).astype(np.float32) for n in lengths]
    steps = [rng.standard_normal((1, 1, m.hidden_size)).astype(np.float32) for _ in lengths]

    async def main() -> None:
        be = await _cluster(model, [node.addr], [(0, m.num_layers - 1)])
        plan = be.cluster.plan_id
        try:
            sink = await _authed(node.port)  # takes the plan's results over from `be`
            await sink.send(msgs.OpenData(id=1, plan_id=plan, role="sink"))
            assert isinstance(await sink.recv(), msgs.DataReady)
            steps_in = await _data(node.port, plan)
            for i, p in enumerate(prompts):  # prefill each session on its own
                await steps_in.send(msgs.Forward(plan_id=plan, session=f"s{i}", step=0, start=0,
                                              hidden=p))
                assert (await asyncio.wait_for(sink.recv(), 10)).error is None
            # all decode steps in one write, so they are read in one go; plus one with a
            # wrong start, which is refused on its own while the others run as a batch
            burst = b"".join(_frame(plan, f"s{i}", 1, n, s)
                             for i, (n, s) in enumerate(zip(lengths, steps, strict=True)))
            steps_in.writer.write(burst + _frame(plan, "s0", 1, 99, steps[0]))
            await steps_in.writer.drain()
            got = {}
            for _ in range(len(lengths) + 1):
                msg = await asyncio.wait_for(sink.recv(), 10)
                got[(msg.session, msg.start)] = msg
            refused = [msg for msg in got.values() if msg.error is not None]
            assert len(refused) == 1 and "starts at 99" in refused[0].error
            for i, (p, s) in enumerate(zip(prompts, steps, strict=True)):
                out = got[(f"s{i}", lengths[i])].hidden
                np.testing.assert_allclose(out, _solo(layers, p, s)[0], atol=1e-5, rtol=0)
            stats = (await be.cluster.stats())[be.plan.stages[0].addr]
            assert stats["batches"] == 1 and stats["batched_steps"] == len(lengths), stats
            await sink.close()
            await steps_in.close()
        finally:
            await be.close()

    asyncio.run(main())
