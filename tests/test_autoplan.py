"""`edgelite generate --nodes` without --split: probe, plan with HiGHS, deploy, generate.

Three real node processes; every link (client -> node and node -> node) runs through the link
emulator, and one node pair is slow. Memory budgets (each process's whole memory) make the plan
use two nodes.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from conftest import run_cli
from edgelite.cli.localnodes import TOKEN
from edgelite.prober.emulator import EmulatorProcess, LinkSpec
from models import as_if_large

pytestmark = pytest.mark.e2e

FAST, SLOW = LinkSpec(delay_ms=8.0), LinkSpec(delay_ms=60.0)


BUDGET_MB = 2000  # each process: with the "as if large" manifest, one layer each


async def _generate_through_emulators(model: Path, ports: list[int], slow: tuple[int, int],
                                      client_mb: float) -> dict:
    n = len(ports)
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    links = [(("127.0.0.1", p), FAST) for p in ports]  # the client's view of each node
    links += [(("127.0.0.1", ports[j]), SLOW if {i, j} == set(slow) else FAST) for i, j in pairs]
    emus = EmulatorProcess()  # its own process: the test's pauses are not link jitter
    try:
        found = await emus.start(links)
        names = [f"127.0.0.1:{tcp}" for tcp, _ in found[:n]]
        routes = []
        for (i, j), (tcp, udp) in zip(pairs, found[n:], strict=True):
            routes += ["--route", f"{names[i]}>{names[j]}=127.0.0.1:{tcp}/{udp}"]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "edgelite", "generate", "--model", str(model), "--json",
            "--nodes", ",".join(names), *routes, "--client-memory-mb", f"{client_mb:.6f}",
            "--token", TOKEN, "--threads", "1", "--max-tokens", "24", "hello there",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 180)
        assert proc.returncode == 0, err.decode()
        return {**json.loads(out), "names": names}
    finally:
        await emus.close()


def test_plan_avoids_slow_link_and_predicts_decode_time(exported, node_factory, tmp_path) -> None:
    # a node fits one layer, the client one besides the embedding and head
    model = as_if_large(exported["llama"], tmp_path / "llama")
    node_mb, client_mb = BUDGET_MB, BUDGET_MB
    nodes = [node_factory(memory_mb=node_mb) for _ in range(3)]
    slow = (0, 2)
    res = asyncio.run(_generate_through_emulators(model, [n.port for n in nodes], slow, client_mb))
    local = json.loads(run_cli("generate", "--model", str(model), "--json", "--max-tokens", "24",
                               "hello there").stdout)
    assert res["token_ids"] == local["token_ids"]

    plan = res["plan"]
    devices = [s["device"] for s in plan["stages"]]
    assert devices[0] == "client" and len(devices) == 3, plan  # memory forces two nodes
    slow_pair = {res["names"][slow[0]], res["names"][slow[1]]}
    assert set(devices[1:]) != slow_pair, f"plan uses the slow link: {devices}"
    assert plan["status"] == "optimal"

    measured, expected = res["decode_ms_per_token"], plan["expected_ms_per_token"]
    assert abs(expected - measured) <= 0.25 * measured, (expected, measured)
