"""`edgelite demo --prompt`: three emulated phones, probe, HiGHS plan, deploy, answer."""

from __future__ import annotations

import itertools
import json

import pytest

from conftest import run_cli

pytestmark = pytest.mark.e2e


def test_demo_answers_like_the_local_runtime_and_avoids_the_lossy_link(smollm2_int4) -> None:
    model = str(smollm2_int4)
    prompt = "What is the capital of France?"
    res = run_cli("demo", "--model", model, "--prompt", prompt, "--json", "--max-tokens", "16",
                  timeout=240)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    local = json.loads(run_cli("generate", "--model", model, "--json", "--max-tokens", "16",
                               prompt).stdout)
    assert out["reply"] == local["text"]
    plan = out["plan"]
    assert plan["status"] == "optimal" and plan["solver"].startswith("highs")
    devices = [s["device"] for s in plan["stages"]]
    assert devices[0] == "client"
    # memory needs all three
    assert {"phone-a", "phone-b", "phone-c"} == set(devices[1:]), (plan["stages"], out["devices"])
    hops = set(itertools.pairwise(devices))
    assert ("phone-a", "phone-c") not in hops and ("phone-c", "phone-a") not in hops, out["links"]
    assert all(n["runs"] > 0 for n in out["nodes"])
