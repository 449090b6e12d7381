"""Rough edges a new user hits: one-line errors, no tracebacks (CLI in a subprocess)."""

from __future__ import annotations

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
