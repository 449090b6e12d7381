"""scripts/termux_setup.sh with `pkg` and `pip` replaced by shims that record their calls (no
network, no Termux): what it installs, that it installs nothing PC-side, that a second run does
not install edgelite again, and that it ends with the LAN address and a node command."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).parent.parent / "scripts" / "termux_setup.sh"
SHIM = """#!/usr/bin/env bash
echo "{name} $*" >> "{log}"
if [ "{name}" = pip ] && [ "$1" = show ]; then [ -f "{state}" ]; exit $?; fi
if [ "{name}" = pip ] && [ "$1" = install ] && [ "$2" = --no-deps ]; then touch "{state}"; fi
exit 0
"""


def _run(tmp: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir, log = tmp / "bin", tmp / "calls.log"
    bin_dir.mkdir(exist_ok=True)
    for name in ("pkg", "pip"):
        shim = bin_dir / name
        shim.write_text(SHIM.format(name=name, log=log, state=tmp / "installed"))
        shim.chmod(0o755)
    log.write_text("")
    res = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    return res, log.read_text().splitlines()


def test_node_setup_then_again_then_client(tmp_path: Path) -> None:
    res, calls = _run(tmp_path)
    assert res.returncode == 0, res.stderr
    assert calls[0] == "pkg install -y python python-numpy python-onnxruntime python-msgpack clang"
    assert "pip install --no-deps edgelite" in calls
    everything = " ".join(calls)
    for pc_side in ("torch", "onnx ", "transformers", "highspy", "uvloop", "tokenizers"):
        assert pc_side not in everything + " ", (pc_side, calls)
    assert "LAN address" in res.stdout and "edgelite node --host 0.0.0.0 --port 7070" in res.stdout
    again, calls = _run(tmp_path)  # idempotent: edgelite is not installed twice
    assert again.returncode == 0 and "pip install --no-deps edgelite" not in calls
    client, calls = _run(tmp_path, "--client")
    assert client.returncode == 0
    assert "pkg install -y tur-repo" in calls and "pip install jinja2" in calls
    assert any(c.startswith("pkg install -y python ") and c.endswith("python-tokenizers")
               for c in calls), calls
    bad = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown argument --bogus" in bad.stderr


SERVICE = Path(__file__).parent.parent / "scripts" / "termux_service.sh"


def _service(tmp: Path, *args: str,
             token: str | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir, log = tmp / "bin", tmp / "calls.log"
    bin_dir.mkdir(exist_ok=True)
    for name in ("pkg", "sv-enable", "sv", "edgelite"):
        shim = bin_dir / name
        shim.write_text(SHIM.format(name=name, log=log, state=tmp / "installed"))
        shim.chmod(0o755)
    log.write_text("")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PREFIX": str(tmp / "usr"),
           "HOME": str(tmp / "home")}
    env.pop("EDGELITE_TOKEN", None)
    if token is not None:
        env["EDGELITE_TOKEN"] = token
    res = subprocess.run(["bash", str(SERVICE), *args], capture_output=True, text=True, timeout=60,
                         env=env)
    return res, log.read_text().splitlines()


def test_node_service_recipe_writes_runit_service_and_boot_script(tmp_path: Path) -> None:
    res, calls = _service(tmp_path, "--port", "7171", "--memory-mb", "900", "--name", "old phone")
    assert res.returncode == 0, res.stderr
    service = tmp_path / "usr" / "var" / "service" / "edgelite-node"
    run = (service / "run").read_text()
    assert "exec edgelite node --host 0.0.0.0 --port 7171 --plain --memory-mb 900 --name old\\ phone" in run
    assert os.access(service / "run", os.X_OK)
    assert os.readlink(service / "log" / "run").endswith("share/termux-services/svlogger")
    boot = (tmp_path / "home" / ".termux" / "boot" / "start-edgelite").read_text()
    assert "termux-wake-lock" in boot and "etc/profile" in boot
    token = tmp_path / "home" / ".edgelite" / "token"
    assert len(token.read_text().strip()) >= 24 and token.stat().st_mode & 0o777 == 0o600
    assert "a new cluster token" in res.stdout and "sv-enable edgelite-node" in calls
    # again with the cluster's token: kept, service rewritten; then removed
    again, _ = _service(tmp_path, token="cluster-secret")
    assert again.returncode == 0 and token.read_text().strip() == "cluster-secret"
    assert (service / "run").read_text().rstrip().endswith("--port 7070 --plain")  # options anew
    gone, calls = _service(tmp_path, "--remove")
    assert gone.returncode == 0 and "sv down edgelite-node" in calls
    assert not service.exists() and not (tmp_path / "home" / ".termux" / "boot" / "start-edgelite").exists()
    assert token.exists()
    bad, _ = _service(tmp_path, "--port", "x1")
    assert bad.returncode == 2 and "not a port number" in bad.stderr
