"""Rough edges a new user hits: one-line errors, no tracebacks (CLI in a subprocess)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys


def _cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgelite", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_bad_and_busy_ports_are_one_line_errors() -> None:
    for cmd in (("node", "--token", "x" * 32), ("serve", "--model", "m", "--users", "u.json")):
        res = _cli(*cmd, "--port", "70000")
        assert res.returncode == 2 and "'70000' is not a port number" in res.stderr, res.stderr
    res = _cli("serve", "--model", "m", "--http", "127.0.0.1:http", "--no-native")
    assert res.returncode == 2 and "'http' is not a port number" in res.stderr, res.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = _cli("node", "--host", "127.0.0.1", "--port", str(port), "--token", "x" * 32)
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip() == (f"error: cannot listen on 127.0.0.1:{port}: the port is in use "
                                  "(another node or program has it; pick another port with "
                                  "--port, or 0 for any free one)")


def test_version() -> None:
    res = _cli("--version")
    assert res.returncode == 0 and res.stdout.startswith("edgelite ")


def _cluster(tmp_path, node_memory: int, latency_ms: float) -> str:
    spec = {"client": "me", "devices": [{"name": "me", "flops": 5e10, "memory_bytes": 4 << 30},
                                        {"name": "far", "flops": 1e10, "memory_bytes": node_memory}],
            "links": [{"src": a, "dst": b, "latency_ms": latency_ms, "bandwidth_mbps": 50}
                      for a, b in (("me", "far"), ("far", "me"))]}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(spec))
    return str(path)


def test_a_plan_that_keeps_every_layer_on_the_client_says_why(exported, tmp_path) -> None:
    model = str(exported["llama"])
    res = _cli("plan", "--model", model, "--cluster", _cluster(tmp_path, 4 << 30, 40.0), "--json")
    out = json.loads(res.stdout)
    assert [s["addr"] for s in out["stages"]] == [None]
    alone, other = out["expected_ms_per_token"], out["with_nodes_ms_per_token"]
    assert other > alone + 40  # a layer on the far node costs at least the hop there and back
    res = _cli("plan", "--model", model, "--cluster", _cluster(tmp_path, 4 << 30, 40.0))
    text = " ".join(res.stdout.split())
    assert res.returncode == 0 and "Traceback" not in res.stdout + res.stderr
    assert (f"the plan runs every layer on this device: predicted {alone:.2f} ms/token alone vs "
            f"{other:.2f} ms/token at best with the nodes") in text, text
    res = _cli("plan", "--model", model, "--cluster", _cluster(tmp_path, 1 << 10, 0.1))
    assert "no node can hold a layer" in " ".join(res.stdout.split()), res.stdout
