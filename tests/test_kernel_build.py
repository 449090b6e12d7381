"""The kernel library's build off the request path and in a child process's check: a node whose
library is still building answers a probe (its profile says "building", measured without it);
a library that dies in its check (as a wrong-ISA build would: SIGILL) is one failed check, the
node falls back to onnxruntime's operators and answers; no build uses -march=native, every one
-ffp-contract=off."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from conftest import run_cli
from edgelite.cli.localnodes import TOKEN
from edgelite.config import RuntimeConfig
from edgelite.engine.kernels import build, cpu
from edgelite.net import messages as m
from test_node_bad_input import _authed

pytestmark = pytest.mark.e2e


def _fake_cc(folder: Path, body: str) -> Path:
    cc = folder / "fake-cc"
    cc.write_text("#!/bin/sh\n" + body + "\n")
    cc.chmod(0o755)
    return cc


def _node_stats(port: int) -> dict:
    async def ask() -> dict:
        conn = await _authed(port)
        try:
            await conn.send(m.StatsRequest(id=1))
            reply = await conn.recv()
            assert isinstance(reply, m.StatsReply), reply
            return reply.stats
        finally:
            await conn.close()

    return asyncio.run(ask())


def test_a_node_answers_a_probe_while_its_kernel_builds(
        node_factory, exported: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as env:  # (the node's compiler takes a minute; the client's is the real one)
        env.setenv("CC", str(_fake_cc(tmp_path, 'sleep 60; exec gcc "$@"')))
        env.setenv("EDGELITE_CACHE", str(tmp_path / "cache"))
        started = time.monotonic()
        node = node_factory(extra=("--set", "kernel_wait_s=2"))
    done = run_cli("probe", "--nodes", node.addr, "--token", TOKEN, "--model", str(exported["llama"]),
                   "--json", timeout=60)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-2000:]
    [dev] = [d for d in json.loads(done.stdout)["devices"] if d["name"] != "client"]
    assert dev["reachable"] and dev["kernel"] == "building" and dev["flops"] > 0, dev
    assert took < 20, f"the probe answered {took:.1f} s after the node started"
    assert "still being built" in done.stderr
    assert _node_stats(node.port)["kernel"] == "building"


def test_a_library_that_dies_in_its_check_leaves_the_node_on_onnxruntimes_operators(
        node_factory, exported: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trap = tmp_path / "trap.h"  # every library this compiler makes dies as it loads, as a wrong-ISA one would
    trap.write_text("static void __attribute__((constructor)) test_trap(void) { __builtin_trap(); }\n")
    gcc = shutil.which("gcc") or "gcc"
    (tmp_path / "bin").mkdir()  # (the only compiler the node finds, by each of the names it tries)
    cc = _fake_cc(tmp_path / "bin", 'case " $* " in *x86_avx*|*arm_*) exit 1;; esac\n'  # (no path: quick)
                                    f'case " $* " in *" -c "*) exec {gcc} "$@" -O0 -include {trap};; esac\n'
                                    f'exec {gcc} "$@"')
    for name in build.COMPILERS:
        (tmp_path / "bin" / name).symlink_to(cc)
    cfg = RuntimeConfig(threads=1)
    family = cpu.machine()
    library, error = build.Build(str(cc), family, frozenset(), folder=tmp_path / "one").run()
    assert library is not None, error
    reason = build.checked(library, cfg)
    assert reason is not None and "SIGILL" in reason and "\n" not in reason, reason
    with monkeypatch.context() as env:
        env.setenv("CC", str(cc))
        env.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
        env.setenv("EDGELITE_CACHE", str(tmp_path / "cache"))
        node = node_factory(log_file=tmp_path / "node.log")
    done = run_cli("generate", "--model", str(exported["llama"]), "--nodes", node.addr, "--token", TOKEN,
                   "--split", "0-2", "--json", "--max-tokens", "4", "--raw", "hello", timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(json.loads(done.stdout)["token_ids"]) == 4
    assert node.proc.poll() is None
    assert _node_stats(node.port)["kernel"] == "none"
    log = (tmp_path / "node.log").read_text()
    assert "died with SIGILL" in log and "using onnxruntime's operators" in log


def test_no_build_asks_for_the_native_cpu_and_every_one_pins_contraction_off() -> None:
    every = [*cpu.base_units("x86"), *cpu.base_units("arm"), *cpu.X86_UNITS, *cpu.ARM_UNITS]
    flags = [f for u in every for f in u.flags] + list(cpu.COMMON)
    assert not any("native" in f for f in flags) and "-ffp-contract=off" in cpu.COMMON
    assert not any("sve" in f for u in cpu.ARM_UNITS for f in u.flags)
    snapdragon = frozenset({"asimd", "asimddp", "i8mm", "fp", "bf16"})  # (8 Gen 1-3: no SVE enabled)
    assert [u.path for u in cpu.units("arm", snapdragon)] == ["ops", "ref", "i8mm"]
    assert [u.path for u in cpu.units("arm", frozenset({"asimd"}))] == ["ops", "ref", "neon"]
    assert cpu.level("x86", frozenset({"avx2", "fma", "f16c"})) == "avx2"
    text = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp " \
           "cpuid asimdrdm lrcpc dcpop asimddp\n"
    assert cpu.features("arm", text) >= {"asimd", "asimddp"}
    assert cpu.level("arm", cpu.features("arm", text)) == "dotprod"
