"""GGUF block types at their own widths, end to end: tiny Llama GGUF files whose matrices are
Q4_1, Q5_0 or Q8_0 (written by the gguf package) export, verify and give transformers' greedy
ids on the dequantized file; 5-bit blocks run as a 4-bit and a 2-bit product unless
--prefer speed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import models
from conftest import GGUF_KINDS as KINDS
from edgelite import manifest as mf
from edgelite.client.local import LocalBackend
from test_distributed import _tokens

pytestmark = pytest.mark.engine

WIDTHS = {"Q4_1": {4}, "Q5_0": {4, 2}, "Q8_0": {8}, "Q4_K+Q6_K": {4, 8}, "Q2_K+Q3_K+Q5_K": {4, 2}}


def _widths(model: Path) -> set[int]:
    """The MatMulNBits widths of the export's layers."""
    import onnx

    out = set()
    for path in model.glob("layer_*.onnx"):
        m = onnx.load(str(path), load_external_data=False)
        out |= {a.i for n in m.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
                if a.name == "bits"}
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_exact_exports_give_transformers_ids_on_the_gguf(ggufs: dict[str, Path], kind: str,
                                                        tmp_path: Path) -> None:
    from edgelite_export import build

    g = ggufs[kind]
    exact = build.run(str(g), tmp_path / "exact", build.Options(mode="exact", steps=16))
    fast = build.run(str(g), tmp_path / "fast", build.Options(steps=16))
    assert exact.report.passed and fast.report.passed and exact.report.transcode_max_rel_diff == 0
    assert _widths(fast.out) == WIDTHS[kind]
    # named by the GGUF's general.name, else by its file
    assert exact.manifest.name == (g.stem if kind == "Q8_0" else f"Tiny Llama {kind}")
    hf = models.load_hf(g.parent, g.name)
    prompt = [5, 17, 42, 8, 99, 3]
    want = models.hf_greedy(hf, prompt, 24)
    got = asyncio.run(_tokens(LocalBackend(mf.load(exact.out)), prompt, 24))
    eos = set(exact.manifest.eos_token_ids)
    assert got == want[:next((i for i, t in enumerate(want) if t in eos), 24)]


def test_five_bit_blocks_in_8_bit_storage_when_speed_is_preferred(ggufs: dict[str, Path],
                                                                  tmp_path: Path) -> None:
    from edgelite_export import build

    small = build.run(str(ggufs["Q5_0"]), tmp_path / "size", build.Options(steps=4))
    large = build.run(str(ggufs["Q5_0"]), tmp_path / "speed", build.Options(steps=4, prefer="speed"))
    assert _widths(large.out) == {8} and large.report.passed
    # (in memory: the 8-bit codes are widened from 6 bits a code in the files when they load)
    held = [sum(e.param_bytes for e in r.manifest.layers) for r in (small, large)]
    assert held[0] < 0.85 * held[1], held
