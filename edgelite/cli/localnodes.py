"""Start real `edgelite node` (and `edgelite serve`) processes on 127.0.0.1 and read their
ports back: for the demo, the tests and the benchmarks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

TOKEN = "test-cluster-token"
READY = re.compile(r"listening on ([\d.]+):(\d+)")


@dataclass
class NodeProc:
    proc: subprocess.Popen
    port: int
    data_dir: Path
    banner: str = ""  # the line it printed when it was ready

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def stop(self) -> None:  # SIGSTOP: the process is alive but silent (a stalled phone)
        self.proc.send_signal(signal.SIGSTOP)

    def cont(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


def start_node(data_dir: Path, threads: int = 1, kv_budget_mb: float = 256,
               timeout: float = 30.0, token: str = TOKEN, memory_mb: float | None = None,
               name: str | None = None, extra: tuple[str, ...] = (),
               log_file: Path | None = None, port: int = 0, host: str = "127.0.0.1",
               wrap: tuple[str, ...] = ()) -> NodeProc:
    """A node process; `extra`: more `edgelite node` flags; `log_file`: where its log goes
    (else nowhere); `port` 0: any free one; `wrap`: a command it runs under (e.g. `ip netns
    exec NS`)."""
    env = {**os.environ, "EDGELITE_TOKEN": token}
    extra = (*([] if memory_mb is None else ["--memory-mb", str(memory_mb)]),
             *([] if name is None else ["--name", name]), *extra)
    log = subprocess.DEVNULL if log_file is None else log_file.open("ab")
    try:
        proc = subprocess.Popen(
            [*wrap, sys.executable, "-m", "edgelite", "node", "--host", host, "--port", str(port),
             "--data-dir", str(data_dir), "--threads", str(threads), "--kv-budget-mb",
             str(kv_budget_mb), *extra], stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    finally:
        if log_file is not None:
            log.close()  # type: ignore[union-attr]
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"node exited with {proc.returncode}")
        if m := READY.search(line):
            return NodeProc(proc, int(m.group(2)), data_dir, line.strip())
    proc.kill()
    proc.wait(10)
    proc.stdout.close()
    raise RuntimeError("node did not start in time")


def start_serve(args: list[str], log: IO[str], pattern: str = r"listening on [\d.]+:(\d+)",
                timeout: float = 60.0) -> tuple[subprocess.Popen, re.Match]:
    """`edgelite -v serve ARGS` as a process (its log to `log`); returned with the match once a
    line of its stdout matches `pattern` (default: the native port)."""
    proc = subprocess.Popen([sys.executable, "-m", "edgelite", "-v", "serve", *args],
                            stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ})
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if found := re.search(pattern, line):
            return proc, found
        if not line and proc.poll() is not None:
            break
    proc.kill()
    proc.wait(10)
    proc.stdout.close()
    raise RuntimeError("edgelite serve did not start (see its log)")


def stop_serve(proc: subprocess.Popen) -> None:
    """End a `start_serve` process (killed, waited for, its stdout closed)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def wait_healthy(base: str, timeout: float = 120.0) -> bool:
    """Wait for the HTTP API at `base` (http://HOST:PORT) to answer /health with 200 (it says
    503 until its plan is deployed); False if it did not within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):  # (HTTPError 503 is a URLError)
            pass
        time.sleep(0.2)
    return False
