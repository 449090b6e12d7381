"""Prober against real nodes, through the userspace link emulator."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli
from edgelite.cli.localnodes import TOKEN
from edgelite.config import WireLimits
from edgelite.ids import NodeAddr
from edgelite.net import linkprobe as prober
from edgelite.net import messages as m
from edgelite.net.handshake import connect
from edgelite.prober.emulator import EmulatorProcess, LinkSpec
from test_distributed import _cluster

pytestmark = pytest.mark.e2e


async def _probe_via(node_a, node_b, spec: LinkSpec, seed: int = 3) -> prober.LinkStats:
    """Node A measures its link to node B through an emulator in front of B."""
    # in a process of its own: a garbage-collection pause of the test process (tens of ms late
    # in the suite) would otherwise show up as link jitter
    emu = EmulatorProcess()
    ((tcp, udp),) = await emu.start([(("127.0.0.1", node_b.port), spec)], seed)
    try:
        conn, _ = await connect(NodeAddr("127.0.0.1", node_a.port), TOKEN, None, WireLimits(), 5)
        try:
            await conn.send(m.ProbeLink(id=1, peer=NodeAddr("127.0.0.1", tcp, udp),
                                        config={"udp_packets": 400}))
            reply = await asyncio.wait_for(conn.recv(), 60)
        finally:
            await conn.close()
    finally:
        await emu.close()
    assert isinstance(reply, m.LinkReport), reply
    link = dict(reply.link)
    link["loss_ci95"] = tuple(link["loss_ci95"])
    return prober.LinkStats(**link)


@pytest.mark.parametrize("spec", [LinkSpec(20, 5, 10, 0.03), LinkSpec(20, 5, 50, 0.0)],
                         ids=["10mbit-3pct-loss", "50mbit-no-loss"])
def test_emulated_link_measured_within_tolerance(node_factory, spec: LinkSpec) -> None:
    a, b = node_factory(), node_factory()
    st = asyncio.run(_probe_via(a, b, spec))
    assert st.reachable
    assert st.latency_ms == pytest.approx(spec.delay_ms, rel=0.15)
    assert st.bandwidth_mbps == pytest.approx(spec.rate_mbps, rel=0.15)
    # max - min of +-5 ms without the one largest and smallest delay (one scheduling hiccup of
    # this 2-core machine, which the planner also ignores, once put 4 ms on the raw max - min)
    assert st.jitter_trim_ms == pytest.approx(2 * spec.jitter_ms, rel=0.30)
    assert st.jitter_ms >= st.jitter_trim_ms
    lo, hi = st.loss_ci95
    assert lo <= spec.loss <= hi, (st.loss, st.loss_ci95)
    assert time.time() - st.measured_at < 120


def test_unreachable_peer_is_a_measurement() -> None:
    async def main() -> prober.LinkStats:
        t0 = time.monotonic()
        st = await prober.probe_peer(NodeAddr("127.0.0.1", 9), TOKEN, prober.ProbeConfig(timeout_s=1))
        assert time.monotonic() - t0 < 3
        return st

    st = asyncio.run(main())
    assert not st.reachable and "127.0.0.1:9" in st.reason


def test_probe_cli_matrix_and_flops_prediction(exported, node_factory) -> None:
    nodes = [node_factory() for _ in range(3)]
    env_token = {"EDGELITE_TOKEN": TOKEN}
    os.environ.update(env_token)
    t0 = time.monotonic()
    res = run_cli("probe", "--nodes", ",".join(n.addr for n in nodes), "--json", timeout=60)
    elapsed = time.monotonic() - t0
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert len(out["devices"]) == 4 and len(out["links"]) == 4 * 3
    assert all(r["reachable"] and r["bandwidth_mbps"] > 100 for r in out["links"])
    assert elapsed < 15
    for d in out["devices"][1:]:
        assert d["flops"] > 0 and d["memory_total_bytes"] > 0 and d["cpu_count"] >= 1


@pytest.mark.slow  # the prediction varied 1.12-1.61 ms across runs on the 2-core CI machine
def test_layer_flops_predict_decode_time(smollm2, node_factory) -> None:
    """FLOP/s measured on a deployed SmolLM2 layer predicts its decode time within 20 %, in a
    10-layer stage (where, as in real decoding, the other layers evict each one's weights)."""
    node = node_factory()

    async def main() -> tuple[float, float]:
        be = await _cluster(smollm2[0], [node.addr], [(0, 9)])
        try:
            link = be.cluster.link(NodeAddr.parse(node.addr))
            prof = (await link.request(m.ProfileRequest(id=0), m.ProfileReply, 30)).profile
            layer = be.manifest.layers[0]
            predicted_ms = layer.flops_per_token / prof["flops"] * 1e3
            import numpy as np

            await be.forward("p", np.full((1, 64), 5, np.int64))
            stats0 = (await link.request(m.StatsRequest(id=0), m.StatsReply, 5)).stats  # decode only
            for _ in range(40):
                await be.forward("p", np.full((1, 1), 5, np.int64))
            stats1 = (await link.request(m.StatsRequest(id=0), m.StatsReply, 5)).stats
            runs = stats1["runs"] - stats0["runs"]
            total = stats1["ms_per_run"] * stats1["runs"] - stats0["ms_per_run"] * stats0["runs"]
            return predicted_ms, total / runs / 10
        finally:
            await be.close()

    predicted, measured = asyncio.run(main())
    assert predicted == pytest.approx(measured, rel=0.2)


NETNS = shutil.which("ip") is not None and os.geteuid() == 0


@pytest.mark.skipif(not NETNS, reason="needs root and iproute2 (ip netns) to build test hosts")
def test_netns_veth_tbf_20mbit(tmp_path: Path) -> None:
    ns = [f"edl{os.getpid()}a", f"edl{os.getpid()}b"]
    sh = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True)  # noqa: E731
    try:
        try:
            for n in ns:
                sh("ip", "netns", "add", n)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"ip netns not permitted here: {exc.stderr.decode().strip()}")
        va, vb = f"va{os.getpid() % 100000}", f"vb{os.getpid() % 100000}"
        sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        sh("ip", "link", "set", va, "netns", ns[0])
        sh("ip", "link", "set", vb, "netns", ns[1])
        for n, dev, addr in ((ns[0], va, "10.231.0.1/24"), (ns[1], vb, "10.231.0.2/24")):
            sh("ip", "netns", "exec", n, "ip", "addr", "add", addr, "dev", dev)
            sh("ip", "netns", "exec", n, "ip", "link", "set", dev, "up")
            sh("ip", "netns", "exec", n, "ip", "link", "set", "lo", "up")
            sh("ip", "netns", "exec", n, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
               "20mbit", "burst", "32kbit", "latency", "400ms")
        env = {**os.environ, "EDGELITE_TOKEN": TOKEN}
        procs = []
        for n, ip in ((ns[0], "10.231.0.1"), (ns[1], "10.231.0.2")):
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", n, sys.executable, "-m", "edgelite", "node", "--host", ip,
                 "--port", "7071", "--data-dir", str(tmp_path / n)], env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(4)
        res = subprocess.run(["ip", "netns", "exec", ns[0], sys.executable, "-m", "edgelite",
                              "probe", "--nodes", "10.231.0.1:7071,10.231.0.2:7071", "--json",
                              "--repeat", "2"],
                             capture_output=True, text=True, timeout=120, env=env)
        for p in procs:
            p.kill()
            p.wait(10)
        assert res.returncode == 0, res.stderr
        rows = {(r["src"], r["dst"]): r for r in json.loads(res.stdout)["links"]}
        bw = rows["10.231.0.1:7071", "10.231.0.2:7071"]["bandwidth_mbps"]
        assert bw == pytest.approx(20, rel=0.10)
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def test_smoothing_is_bias_corrected_and_skips_unreachable_rounds() -> None:
    from edgelite.prober.cluster import smooth

    def row(lat: float, ok: bool = True) -> dict:
        st = prober.LinkStats(lat, 1.0, 0.5, 100.0, 0.0, (0.0, 0.01), 10, 10) if ok else \
            prober.unreachable("down")
        return {"src": "a", "dst": "b", **st.to_json()}

    once = smooth([[row(10.0)]])[0]
    assert once["latency_ms"] == pytest.approx(10.0) and once["samples"] == 1  # no bias to 0
    three = smooth([[row(10.0)], [row(float("nan"), ok=False)], [row(20.0)]])[0]
    assert three["samples"] == 2 and three["reachable"]
    assert 10.0 < three["latency_ms"] < 20.0
    down = smooth([[row(0, ok=False)]])[0]
    assert not down["reachable"] and down["samples"] == 0


def test_probe_reports_a_dead_node_and_measures_the_others(node_factory) -> None:
    import socket

    nodes = [node_factory() for _ in range(2)]
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    os.environ["EDGELITE_TOKEN"] = TOKEN
    res = run_cli("probe", "--nodes", ",".join([*(n.addr for n in nodes), dead]), "--json",
                  timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    devices = {d["name"]: d for d in out["devices"]}
    assert not devices[dead]["reachable"] and "refused" in devices[dead]["reason"]
    assert all(devices[n.addr]["reachable"] and devices[n.addr]["flops"] > 0 for n in nodes)
    rows = {(r["src"], r["dst"]): r for r in out["links"]}
    assert not rows["client", dead]["reachable"] and not rows[nodes[0].addr, dead]["reachable"]
    assert rows["client", nodes[0].addr]["reachable"] and rows[nodes[0].addr, nodes[1].addr]["reachable"]
