"""Failover of a model no device holds: a reply on nodes that each hold a part of it, one
node killed (-9) mid-reply.

    python scripts/bench_failover_large.py --model DIR [--nodes 5] [--node-mb 1536]
        [--client-mb 1024] [--tokens 32] [--at 12]

`--nodes` node processes on loopback at `--node-mb` each, 1 thread (the planner, HiGHS, picks
which hold what: with one more node than the model needs, the one left is the spare); the client
at `--client-mb`. First a reference reply, then the same on fresh nodes with the busiest
planned node killed after `--at` tokens. Prints one JSON object: both plans, the ids' identity,
the recovery's parts (detect, plan, deploy, rebuild), what the deploy uploaded to each node,
every process's peak RSS against its budget.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import edgelite
from edgelite.cli.localnodes import TOKEN, NodeProc, start_node
from edgelite.config import RuntimeConfig

PROMPT = "Write a short story about a phone that learns to sing."
UPLOADS: list[str] = []  # the client's deploy lines: what went to each node, in bytes


class _Uploads(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        UPLOADS.append(f"{time.strftime('%H:%M:%S')} {record.getMessage()}")
HWM = re.compile(r"^VmHWM:\s+(\d+) kB", re.M)


def peak_mib(pid: int) -> float:
    m = HWM.search(Path(f"/proc/{pid}/status").read_text())
    return round(int(m.group(1)) / 1024, 1) if m else 0.0


async def reply(model: Path, nodes: list[NodeProc], client_mb: float, tokens: int,
                at: int | None) -> dict[str, Any]:
    planning = edgelite.PlanOptions(client_memory_bytes=int(client_mb * 2**20))
    async with edgelite.connect(model, nodes=[n.addr for n in nodes], token=TOKEN, planning=planning,
                                runtime=RuntimeConfig(threads=1, allow_spinning=False)) as llm:
        assert llm.plan is not None
        first = [(s.device, s.first, s.last) for s in llm.plan.stages]
        busiest = max((s for s in llm.plan.stages if s.addr is not None), key=lambda s: s.last - s.first)
        ids: list[int] = []
        t_fault = gap = None
        t0 = time.monotonic()
        chat = [{"role": "user", "content": PROMPT}]
        async for piece in llm.chat(chat, max_tokens=tokens, temperature=0.0):
            if piece.token_id is None:
                continue
            if t_fault is not None and gap is None:
                gap = time.monotonic() - t_fault
            ids.append(piece.token_id)
            if at is not None and len(ids) == at:
                victim = next(n for n in nodes if n.addr == str(busiest.addr))
                victim.kill()
                t_fault = time.monotonic()
        out: dict[str, Any] = {"ids": ids, "plan": first, "seconds": round(time.monotonic() - t0, 1)}
        if llm.recoveries:
            r = llm.recoveries[0]
            assert t_fault is not None
            out.update({"killed": str(busiest.addr),
                        "fault_to_next_token_s": None if gap is None else round(gap, 2),
                        "detect_ms": round((r.detected_at - t_fault) * 1e3 + r.detect_ms, 1),
                        "plan_ms": round(r.plan_ms, 1), "deploy_ms": round(r.deploy_ms, 1),
                        "rebuild_ms": round(r.rebuild_ms, 1), "new_plan": r.plan})
        return out


def one_case(args: argparse.Namespace, at: int | None) -> dict[str, Any]:
    """One reply on fresh nodes, in this process (a fresh one per case: the client's budget
    counts what the process holds, and a first reply's memory would count against a second)."""
    upload_log = logging.getLogger("edgelite.net.upload")
    upload_log.setLevel(logging.INFO)
    upload_log.addHandler(_Uploads())
    tmp = Path(tempfile.mkdtemp())
    nodes = [start_node(tmp / f"n{i}", threads=1, memory_mb=args.node_mb,
                        extra=("--no-spin", "--discovery-port", "0")) for i in range(args.nodes)]
    try:
        out = asyncio.run(reply(args.model, nodes, args.client_mb, args.tokens, at))
        out["node_peak_rss_mib"] = [peak_mib(n.proc.pid) if n.proc.poll() is None else None for n in nodes]
        out["client_peak_rss_mib"] = peak_mib(os.getpid())
        out["uploads"] = list(UPLOADS)
        return out
    finally:
        for n in nodes:
            n.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--nodes", type=int, default=5)
    ap.add_argument("--node-mb", type=float, default=1536)
    ap.add_argument("--client-mb", type=float, default=1024)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--at", type=int, default=12)
    ap.add_argument("--case", choices=["reference", "kill"], help="(one case, in this process)")
    args = ap.parse_args()
    if args.case is not None:
        print(json.dumps(one_case(args, None if args.case == "reference" else args.at)))
        return
    results: dict[str, Any] = {}
    for case in ("reference", "kill"):
        done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--case", case], capture_output=True,
                              text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{case}: {done.stderr.strip().splitlines()[-1:]}")
        results[case] = json.loads(done.stdout)
    ref = results["reference"].pop("ids")
    results["kill"]["ids_identical"] = results["kill"].pop("ids") == ref
    results["tokens"] = len(ref)
    print(json.dumps({"model": str(args.model), "nodes": args.nodes, "node_budget_mib": args.node_mb,
                      "client_budget_mib": args.client_mb, "results": results}, indent=1))


if __name__ == "__main__":
    main()
