"""The model families beyond Llama (Gemma 3, Qwen3, Phi-3, Llama 3 RoPE scaling, Mistral with a
sliding window) on tiny random models built from transformers' own configs: the exports give
transformers' greedy ids, locally and on node processes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import models
from edgelite import manifest as mf
from edgelite.client.local import LocalBackend
from test_distributed import _cluster, _tokens

pytestmark = pytest.mark.e2e
FAMILIES = list(models.FAMILIES)
PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog",
           # longer than every window, and long enough for windowed layers to give pages back
           " ".join(models.CORPUS[:6])]
STEPS = 32


@pytest.fixture(scope="module")
def family_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: models.build(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def family_exports(family_sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                   ) -> dict[tuple[str, str], Path]:
    """Each family as fp32, int8 exact and int8 fast (all verified by the exporter)."""
    from edgelite_export import build

    root = tmp_path_factory.mktemp("family-exports")
    out = {}
    for f, src in family_sources.items():
        for quant, mode in (("none", "fast"), ("int8", "exact"), ("int8", "fast")):
            res = build.run(str(src), root / f"{f}-{quant}-{mode}",
                            build.Options(quantize=quant, mode=mode, steps=16))
            out[f, f"{quant}-{mode}"] = res.out
    return out


def _prompt_ids(tok: Any, text: str) -> list[int]:
    from edgelite_export.build import prompt_ids

    return prompt_ids(tok, text)


def _dequantized(model: Any) -> Any:
    """The model with every weight the int8 export quantizes replaced by its dequantized
    values: what an exact export computes with float activations."""
    import torch

    from edgelite_export import blocks

    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2 and p.shape[1] % 32 == 0:
                w = blocks.quantize_int8(p.detach().float().numpy()).dequantize()
                p.copy_(torch.from_numpy(w))
    return model


async def _local_ids(model: Path, prompt: list[int]) -> list[int]:
    return await _tokens(LocalBackend(mf.load(model)), prompt, STEPS)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_and_exact_exports_give_transformers_greedy_ids(
        family: str, family_sources: dict[str, Path],
        family_exports: dict[tuple[str, str], Path]) -> None:
    from transformers import AutoTokenizer

    src = family_sources[family]
    tok = AutoTokenizer.from_pretrained(src)
    hf, deq = models.load_hf(src), _dequantized(models.load_hf(src))
    eos = set(mf.load(family_exports[family, "none-fast"]).eos_token_ids)
    for text in PROMPTS:
        prompt = _prompt_ids(tok, text)
        for model, export in ((hf, "none-fast"), (deq, "int8-exact")):
            want = models.hf_greedy(model, prompt, STEPS)
            want = want[:next((i for i, t in enumerate(want) if t in eos), STEPS)]
            got = asyncio.run(_local_ids(family_exports[family, export], prompt))
            assert got == want, (family, export, text)


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_exports_pass_verification(family: str,
                                        family_exports: dict[tuple[str, str], Path]) -> None:
    v = mf.load(family_exports[family, "int8-fast"]).verification
    assert v["passed"] and v["kld"] <= v["thresholds"]["kld"], v


def test_windowed_layers_hold_at_most_their_window(family_exports: dict[tuple[str, str], Path]) -> None:
    """Gemma 3's local layers (window 8 here) give back the pages of positions no query
    reaches any more; its global layer keeps them all."""
    from edgelite.config import RuntimeConfig
    from edgelite.engine.layers import LayerRange, export_files

    m = mf.load(family_exports["gemma3", "none-fast"])
    assert [e.window for e in m.layers] == [8, 0, 8] and "local" in m.rope
    layers = LayerRange(m, 0, 2, RuntimeConfig(threads=1), export_files(m))
    slot = layers.pool.acquire()
    h = np.random.default_rng(0).standard_normal((1, 200, m.hidden_size)).astype(np.float32)
    for a in range(0, 200, 50):
        layers.run(slot, h[:, a:a + 50])
    kv = layers.pool.view(slot)  # (layers, 2, kv_heads, max_length, head_dim)
    assert slot.length == 200 and slot.released >= 100
    assert not kv[0, :, :, :100].any() and not kv[2, :, :, :100].any()  # given back: zeros
    assert kv[0, :, :, 192:200].all() and kv[1, :, :, :200].all()
    layers.close()


def test_three_nodes_give_the_local_ids(family_exports: dict[tuple[str, str], Path],
                                        node_factory: Any) -> None:
    nodes = [node_factory(threads=1) for _ in range(3)]
    prompt = [5, 17, 42, 8, 99, 3, 12, 60, 61, 62, 63, 7]

    async def main() -> None:
        for f in FAMILIES:
            model = family_exports[f, "int8-fast"]
            n = mf.load(model).num_layers
            split = [(0, 0), (1, 1), (2, n - 1)] if n == 3 else [(0, 0), (1, 1)]
            local = await _local_ids(model, prompt)
            be = await _cluster(model, [x.addr for x in nodes[:len(split)]], split)
            try:
                assert await _tokens(be, prompt, STEPS) == local, f
            finally:
                await be.close()

    asyncio.run(main())
