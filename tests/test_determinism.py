"""The same request gives the same answer (engine/passes/invariant.py): each position's output is the
same bit for bit however its step was cut (one token, chunks, padding), so a reply's ids and
log probabilities do not depend on the KV store, the split or other sessions running beside
it. The full check, on SmolLM2 with failover and HTTP, is scripts/check_determinism.py."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import edgelite
from edgelite import manifest as mf
from edgelite.cli.localnodes import TOKEN
from edgelite.config import KVStoreConfig, RuntimeConfig
from edgelite.engine.layers import LayerRange, export_files

CFG = RuntimeConfig(threads=1, prefill_chunks=(4, 16), kv_buckets=(64, 128))
PROMPT = [5, 17, 42, 8, 99, 3, 61, 7, 12, 30, 44, 2, 9, 71, 15, 23, 4, 56, 19]


def _outputs(layers: LayerRange, hidden: np.ndarray, cuts: list[int]) -> np.ndarray:
    slot = layers.pool.acquire()
    out, pos = [], 0
    for n in cuts:
        out.append(layers.run(slot, hidden[:, pos:pos + n]))
        pos += n
    layers.pool.release(slot)
    return np.concatenate(out, axis=1)


@pytest.mark.engine
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_position_is_the_same_however_its_step_was_cut(exported, arch: str) -> None:
    m = mf.load(exported[arch])
    hidden = np.random.default_rng(3).standard_normal((1, 23, m.hidden_size)).astype(np.float32)
    layers = LayerRange(m, 0, m.num_layers - 1, CFG, export_files(m))
    whole = _outputs(layers, hidden, [16, 7])
    for cuts in ([1] * 23, [3, 1, 16, 1, 1, 1], [4, 4, 4, 4, 4, 3], [11, 12]):
        np.testing.assert_array_equal(_outputs(layers, hidden, cuts), whole, err_msg=str(cuts))


async def _reply(llm, session: str | None = None) -> tuple[list[int], list[float], int]:
    reply = llm.complete(PROMPT, max_tokens=12, temperature=0.0, logprobs=0, session=session)
    ids, lps = [], []
    async for p in reply:
        if p.token_id is not None:
            ids.append(p.token_id)
            lps.append(p.logprob)
    return ids, lps, reply.stats.reused_tokens


@pytest.mark.e2e
def test_store_hit_splits_and_two_at_once_give_the_local_reply(exported, node_factory,
                                                               tmp_path: Path) -> None:
    """Ids and log probabilities, compared exactly: a store miss and a hit; two splits over
    two nodes; two replies at once on those nodes."""
    model = exported["llama"]
    m = mf.load(model)
    nodes = [node_factory() for _ in range(2)]
    off = replace(CFG, kv_store=KVStoreConfig(budget_bytes=0))
    on = replace(CFG, kv_store=KVStoreConfig(dir=str(tmp_path / "kv")))

    async def main() -> dict[str, object]:
        out: dict[str, object] = {}
        async with edgelite.connect(model, runtime=off) as llm:
            out["alone"] = await _reply(llm)
        async with edgelite.connect(model, runtime=on) as llm:
            out["miss"] = await _reply(llm)
            out["hit"] = await _reply(llm)  # (the prompt's KV read back from the store)
        for name, split in (("split 0-0,1-2", [(0, 0), (1, m.num_layers - 1)]),
                            ("split 0-1,2-2", [(0, m.num_layers - 2), (m.num_layers - 1,) * 2])):
            async with edgelite.connect(model, nodes=[n.addr for n in nodes], token=TOKEN,
                                        split=split, runtime=off) as llm:
                out[name] = await _reply(llm)
                out[f"{name}, two at once"] = await asyncio.gather(_reply(llm, "x"), _reply(llm, "y"))
        return out

    out = asyncio.run(main())
    ids, lps, _ = out.pop("alone")  # type: ignore[misc]
    assert out["hit"][2] > 0 and out["miss"][2] == 0, (out["miss"], out["hit"])  # type: ignore[index]
    for name, got in out.items():
        for reply in (got if isinstance(got, list) else [got]):
            assert reply[:2] == (ids, lps), name  # type: ignore[index]


@pytest.mark.e2e
@pytest.mark.parametrize("dtype,tol", [("float16", 0.05), ("int8", 0.25)])
def test_narrow_kv_gives_one_reply_locally_from_the_store_and_on_nodes(exported, node_factory, tmp_path: Path,
                                                                       dtype: str, tol: float) -> None:
    """--kv-dtype float16 (each position costs half) or int8 (codes and a two-byte step a
    head's row): the reply is the same locally, after a store hit and split over two nodes of
    that KV (ids and log probabilities exactly), and close to the float32 KV's."""
    model = exported["qwen2"]
    m = mf.load(model)
    half = replace(CFG, kv_dtype=dtype)
    full_range = LayerRange(m, 0, m.num_layers - 1, CFG, export_files(m))
    half_range = LayerRange(m, 0, m.num_layers - 1, half, export_files(m))
    row = {"float16": 2 * m.head_dim, "int8": m.head_dim + 2}[dtype]  # bytes a head's row
    assert half_range.pool.token_bytes * 4 * m.head_dim == full_range.pool.token_bytes * row
    assert m.kv_bytes(0, m.num_layers - 1, 100, dtype) == half_range.pool.token_bytes * 100
    nodes = [node_factory(extra=("--kv-dtype", dtype)) for _ in range(2)]
    off = replace(half, kv_store=KVStoreConfig(budget_bytes=0))
    on = replace(half, kv_store=KVStoreConfig(dir=str(tmp_path / "kv")))

    async def main() -> dict[str, tuple[list[int], list[float], int]]:
        out = {}
        async with edgelite.connect(model, runtime=replace(off, kv_dtype="float32")) as llm:
            out["float32"] = await _reply(llm)
        async with edgelite.connect(model, runtime=off) as llm:
            out["alone"] = await _reply(llm)
        async with edgelite.connect(model, runtime=on) as llm:
            out["miss"] = await _reply(llm)
            out["hit"] = await _reply(llm)
        async with edgelite.connect(model, nodes=[n.addr for n in nodes], token=TOKEN,
                                    split=[(0, 0), (1, m.num_layers - 1)], runtime=off) as llm:
            out["split"] = await _reply(llm)
        return out

    out = asyncio.run(main())
    assert out["hit"][2] > 0
    for name in ("miss", "hit", "split"):
        assert out[name][:2] == out["alone"][:2], name
    np.testing.assert_allclose(out["alone"][1], out["float32"][1], atol=tol)
