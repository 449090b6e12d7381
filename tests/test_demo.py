"""`edgelite demo --prompt`: three emulated phones, probe, HiGHS plan, deploy, answer."""

from __future__ import annotations

import contextlib
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


def test_ctrl_c_during_the_probe_ends_the_demo_quietly(smollm2_int4) -> None:
    """Ctrl-C (SIGINT to the terminal's whole process group) while the demo probes: it ends
    within seconds, with no traceback from any of its processes (the link emulator's printed
    ~130 lines)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "edgelite", "demo", "--model", str(smollm2_int4),
                             "--prompt", "hi", "--max-tokens", "4"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        seen = []
        deadline = time.monotonic() + 120
        for line in proc.stdout:  # (bounded: the demo's first words)
            seen.append(line)
            if "then answers" in line or time.monotonic() > deadline:
                break
        time.sleep(6.0)  # (its nodes started, into the probe)
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    text = "".join(seen) + rest
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-4000:]
    assert len(rest.splitlines()) <= 10, rest
