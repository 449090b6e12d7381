"""Each program in examples/ runs against the tiny model (real nodes, real sockets)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli
from edgelite.cli.localnodes import TOKEN

EXAMPLES = Path(__file__).parent.parent / "examples"
pytestmark = pytest.mark.e2e


def _run(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    res = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True,
                         text=True, timeout=180, env=env)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    return res.stdout


def test_local_cluster_matches_the_local_runtime(exported, tmp_path) -> None:
    model = str(exported["llama"])
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = _run("local_cluster.py", "--model", model, "--max-tokens", "8", "hello",
               env={**os.environ, "TMPDIR": str(tmp)})
    assert list(tmp.iterdir()) == []  # the nodes' folders are gone
    local = json.loads(run_cli("generate", "--model", model, "--json", "--max-tokens", "8",
                               "hello").stdout)
    assert out.startswith(local["text"])
    assert "tokens over 2 nodes" in out


def test_plan_what_if_places_every_layer(exported) -> None:
    model = exported["llama"]
    out = json.loads(_run("plan_what_if.py", "--model", str(model), "--json"))
    stages = out["stages"]
    assert stages[0]["first_layer"] == 0 and out["status"] == "optimal"
    n_layers = json.loads((model / "manifest.json").read_text())["num_layers"]
    assert stages[-1]["last_layer"] == n_layers - 1


def test_chat_client_holds_a_conversation(exported, node_factory) -> None:
    nodes = [node_factory(), node_factory()]
    out = _run("chat_client.py", "--model", str(exported["llama"]), "--nodes",
               ",".join(n.addr for n in nodes), "--token", TOKEN, "--max-tokens", "6")
    assert out.startswith("plan: [('client', 0,")  # the client holds layer 0 by default
    assert out.count("> ") == 2
    if out.startswith("plan: [('client', 0, 2)]"):  # the nodes got nothing: it says why
        assert "every layer runs here: predicted" in out
