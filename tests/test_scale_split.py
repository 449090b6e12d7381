"""Issue 64's path at a scaled-down shape: a model of many layers and small width whose
manifest says its layers are large (models.as_if_large), so that budgets of 2,000 MiB a
process hold three layers each: `edgelite generate --nodes` (probe, HiGHS, deploy) must split
it across the client and all four node processes, give the ids the model gives in one process,
and keep every node within its budget."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli
from edgelite.cli.localnodes import TOKEN
from models import as_if_large
from models import build as build_hf

pytestmark = pytest.mark.e2e
LAYERS = 15  # client 3 + 4 nodes x 3: no fewer processes hold them
BUDGET_MB = 2000
LAYER_MIB = 500  # what each layer says it holds (three fit a process's budget beside its own)


def test_a_model_of_many_layers_splits_across_four_nodes_by_their_budgets(
        node_factory, tmp_path: Path) -> None:
    from edgelite_export import build

    hf = build_hf("llama", tmp_path / "hf", num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2)
    model = as_if_large(build.run(str(hf), tmp_path / "x", build.Options(steps=4)).out, tmp_path / "big",
                        layer_mib=LAYER_MIB)
    nodes = [node_factory(memory_mb=BUDGET_MB) for _ in range(4)]
    res = subprocess.run([sys.executable, "-m", "edgelite", "generate", "--model", str(model), "--json",
                          "--nodes", ",".join(n.addr for n in nodes), "--client-memory-mb", str(BUDGET_MB),
                          "--token", TOKEN, "--threads", "1", "--max-tokens", "24", "hello there"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    local = json.loads(run_cli("generate", "--model", str(model), "--json", "--max-tokens", "24",
                               "hello there").stdout)
    assert out["token_ids"] == local["token_ids"]
    stages = out["plan"]["stages"]
    assert stages[0]["device"] == "client" and len(stages) == 5, stages
    assert len({s["device"] for s in stages[1:]}) == 4, stages  # (every node, each once)
    held = [s["last_layer"] - s["first_layer"] + 1 for s in stages]
    assert sum(held) == LAYERS and max(held) <= 3, held
    for n in nodes:
        with open(f"/proc/{n.proc.pid}/status") as f:
            peak = next(int(x.split()[1]) for x in f if x.startswith("VmHWM")) / 1024
        assert peak <= BUDGET_MB, peak
