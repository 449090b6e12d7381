"""`edgelite generate --nodes` without --split: probe, plan with HiGHS, deploy, generate.

Three real node processes; every link (client -> node and node -> node) runs through the link
emulator, and one node pair is slow. Memory budgets make the plan use two nodes.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from conftest import run_cli
from edgelite import manifest as mf
from edgelite.cli.localnodes import TOKEN
from edgelite.planner.spec import KV_TOKENS
from edgelite.prober.emulator import EmulatorProcess, LinkSpec

FAST, SLOW = LinkSpec(delay_ms=8.0), LinkSpec(delay_ms=60.0)


def _budgets(model: Path) -> tuple[float, float]:
    """(node MiB, client MiB): a node fits one layer, the client one layer besides embed+head."""
    m = mf.load(model)
    layer = max(e.param_bytes + e.kv_bytes_per_token * KV_TOKENS for e in m.layers)
    reserved = m.embed.param_bytes + m.head.param_bytes
    return 1.5 * layer / 0.8 / 2**20, (reserved + 1.5 * layer) / 0.8 / 2**20


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


def test_plan_avoids_slow_link_and_predicts_decode_time(exported, node_factory) -> None:
    model = exported["llama"]
    node_mb, client_mb = _budgets(model)
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
