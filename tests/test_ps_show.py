"""`edgelite show MODEL` (what an export is and what the planner counts for it) and `edgelite ps`
(what runs where): the figures checked against the manifest and against node processes holding
a real plan, as the client that loaded it and as another one (issue 66, item 12)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

import edgelite
from conftest import run_cli
from edgelite.cli.localnodes import TOKEN
from edgelite.cli.ps import BATCHED
from edgelite.manifest import load


@pytest.mark.e2e
def test_show_says_what_the_export_is_and_what_the_planner_counts(exported) -> None:
    model = exported["llama"]
    m = load(model)
    res = run_cli("show", str(model), "--json", "--context", "512")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert (d["layers"], d["kv_heads"], d["head_dim"], d["vocab"]) == (
        m.num_layers, m.num_kv_heads, m.head_dim, m.vocab_size)
    counts = d["planner_counts"]
    item = np.dtype(counts["kv_dtype"]).itemsize
    kv = 2 * 512 * m.num_kv_heads * m.head_dim * item  # K and V of one layer, 512 positions
    assert counts["layer_bytes"] == [e.resident_on(True) + kv for e in m.layers]
    text = run_cli("show", str(model))
    assert text.returncode == 0 and "what the planner counts" in text.stdout, text.stderr
    assert f"{m.num_layers} layers" in text.stdout and "Traceback" not in text.stderr
    bad = run_cli("show", str(model / "nowhere"))
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1, bad.stderr


@pytest.mark.e2e
def test_ps_shows_what_runs_where_to_its_client_only(exported, node_factory, tmp_path) -> None:
    model = exported["llama"]
    m = load(model)
    nodes = [node_factory(memory_mb=400) for _ in range(2)]
    on = ["ps", "--nodes", ",".join(x.addr for x in nodes), "--token", TOKEN]

    async def main() -> tuple[dict, dict, str]:
        async with edgelite.connect(model, nodes=[x.addr for x in nodes], token=TOKEN,
                                    split=[(0, 0), (1, m.num_layers - 1)]) as llm:
            await llm.complete("Hello", max_tokens=2).collect()
            mine = await asyncio.to_thread(run_cli, *on, "--json")
            other = await asyncio.to_thread(run_cli, *on, "--json",
                                            env={"EDGELITE_HOME": str(tmp_path / "other")})
            text = await asyncio.to_thread(run_cli, *on)
        for r in (mine, other, text):
            assert r.returncode == 0, r.stderr
        return json.loads(mine.stdout), json.loads(other.stdout), text.stdout

    mine, other, text = asyncio.run(main())
    got = {s["addr"]: s for s in mine["nodes"]}
    assert [got[x.addr]["stages"][0]["layers"] for x in nodes] == [[0, 0], [1, m.num_layers - 1]]
    assert all(got[x.addr]["stages"][0]["model"] == m.name for x in nodes)
    for s in got.values():
        mem = s["memory"]
        assert mem["budget_bytes"] == 400 << 20 and 0 < mem["rss_bytes"] <= mem["peak_rss_bytes"]
    # another client sees that plans are there, not whose or which
    assert all(s["stages"] == [] and s["other_plans"] == 1 for s in other["nodes"]), other
    assert f"layers 1-{m.num_layers - 1}" in text and "MiB held of 400" in text
    batched = {s["stages"][0]["batched_decode"] for s in got.values()}
    assert len(batched) == 1 and BATCHED[batched.pop()] in text  # (as the node's stats say)
    nodes[1].kill()
    gone = run_cli(*on)
    assert gone.returncode == 0 and f"{nodes[1].addr}: does not answer" in gone.stdout, gone.stdout


@pytest.mark.unit
@pytest.mark.parametrize("stats", [
    {"stages": [{"model": "m"}]},  # (a stage without its layers)
    {"memory": "lots", "stages": []},
    {"stages": [{"model": "m", "layers": 7, "plan_id": "p"}]},
    {"kv_bytes": "x"},
])
def test_ps_says_in_one_line_when_a_nodes_stats_are_not_understood(stats: dict) -> None:
    from edgelite.cli.ps import line

    out = line({"addr": "10.0.0.1:7070", "reachable": True, **stats})
    assert out == [out[0]] and out[0].startswith("10.0.0.1:7070: its stats are not what"), out
