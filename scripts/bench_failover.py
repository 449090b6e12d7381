"""Failover timings on SmolLM2-135M int4 (fast), 3 node processes on loopback, split 0-9 /
10-19 / 20-29, 1 thread each; the client runs embedding and head.

Cases, each on fresh nodes: "kill" (kill -9 of the middle node after 30 of 128 greedy tokens),
"hang" (SIGSTOP of it instead), "kill_in_prompt" (the last node hung then killed while a
~500-token prompt is in flight). For each: the ids against an uninterrupted run, the time from
the fault to the next token, and the recovery's parts: detect (fault -> the loss surfaced in
the client, + pinging the stages), plan, deploy (incl. uploading the files a survivor lacks),
rebuild (the first step after it: the session's history through the new stages). Prints one
JSON object.

    python scripts/bench_failover.py [--tokens 128] [--at 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_local import edgelite_export

import edgelite
from edgelite.cli.localnodes import TOKEN, NodeProc, start_node
from edgelite.config import RuntimeConfig

SPLIT = [(0, 9), (10, 19), (20, 29)]


async def run(model: Path, nodes: list[NodeProc], prompt: str, tokens: int, at: int | None,
              fault: Any, prompt_fault_s: float = 0.3) -> dict[str, Any]:
    async with edgelite.connect(model, nodes=[n.addr for n in nodes], token=TOKEN, split=SPLIT,
                                runtime=RuntimeConfig(threads=1)) as llm:
        ids: list[int] = []
        faulted: list[float] = []
        gap = None

        def do_fault() -> None:
            fault()
            faulted.append(time.monotonic())

        if at == 0:  # while the prompt is in flight
            asyncio.get_running_loop().call_later(prompt_fault_s, do_fault)
        async for piece in llm.chat([{"role": "user", "content": prompt}], max_tokens=tokens,
                                    temperature=0.0):
            if piece.token_id is None:
                continue
            if faulted and gap is None:
                gap = time.monotonic() - faulted[0]
            ids.append(piece.token_id)
            if at is not None and len(ids) == at:
                do_fault()
        t_fault = faulted[0] if faulted else None
        out: dict[str, Any] = {"ids": ids}
        if llm.recoveries:
            r = llm.recoveries[0]
            assert t_fault is not None and gap is not None
            out.update({
                "fault_to_next_token_ms": round(gap * 1e3, 1),
                "detect_ms": round((r.detected_at - t_fault) * 1e3 + r.detect_ms, 1),
                "plan_ms": round(r.plan_ms, 1), "deploy_ms": round(r.deploy_ms, 1),
                "rebuild_ms": round(r.rebuild_ms, 1), "lost": r.lost, "new_plan": r.plan,
                "recoveries": len(llm.recoveries)})
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--at", type=int, default=30)
    ap.add_argument("--models", type=Path, default=Path("models/bench"))
    args = ap.parse_args()
    model = edgelite_export(args.models / "smol-int4-fast")
    tmp = Path(tempfile.mkdtemp())
    short = "Write a short story about a phone that learns to sing."
    long = short + " " + " ".join(f"Item {i} is a small thing;" for i in range(80))
    results: dict[str, Any] = {}
    for case in ("reference", "kill", "hang", "reference_long", "kill_in_prompt"):
        nodes = [start_node(tmp / f"{case}-{i}", threads=1, extra=("--no-spin",)) for i in range(3)]
        victim = nodes[2] if case == "kill_in_prompt" else nodes[1]

        def kill_in_prompt(v: NodeProc = victim) -> None:
            v.stop()
            v.kill()

        fault = {"kill": victim.kill, "hang": victim.stop, "kill_in_prompt": kill_in_prompt}.get(case)
        at = {"kill": args.at, "hang": args.at, "kill_in_prompt": 0}.get(case)
        try:
            tokens = 12 if "long" in case or case == "kill_in_prompt" else args.tokens
            results[case] = asyncio.run(run(model, nodes, long if "long" in case or at == 0 else short,
                                            tokens, at, fault or (lambda: None)))
        finally:
            for n in nodes:
                n.cont()
                n.kill()
    shutil.rmtree(tmp, ignore_errors=True)
    ref, ref_long = results.pop("reference")["ids"], results.pop("reference_long")["ids"]
    for case, r in results.items():
        want = ref_long if case == "kill_in_prompt" else ref
        r["ids_identical"] = r.pop("ids") == want
        r["tokens"] = len(want)
    print(json.dumps({"model": "SmolLM2-135M int4 (fast)", "nodes": 3, "split": SPLIT,
                      "fault_after_tokens": args.at, "results": results}, indent=1))


if __name__ == "__main__":
    main()
