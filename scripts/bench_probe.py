"""Wall time of `edgelite probe --json` for a full matrix over N local nodes (loopback).

Starts N node processes, runs the CLI `--runs` times (with and without --model), prints JSON.
Usage: python scripts/bench_probe.py [--nodes 4] [--runs 3] [--model models/smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from edgelite.cli.localnodes import TOKEN, start_node


def timed_probe(addrs: str, extra: list[str]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "edgelite", "probe", "--nodes", addrs, "--json",
                          *extra], capture_output=True, text=True, check=True,
                         env={**os.environ, "EDGELITE_TOKEN": TOKEN})
    return time.perf_counter() - t0, json.loads(res.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model", type=Path, default=Path("models/smollm2-135m"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="edgelite-probe-"))
    nodes = [start_node(tmp / f"n{i}") for i in range(args.nodes)]
    try:
        addrs = ",".join(n.addr for n in nodes)
        plain = [timed_probe(addrs, []) for _ in range(args.runs)]
        model = ([timed_probe(addrs, ["--model", str(args.model)]) for _ in range(args.runs)]
                 if (args.model / "manifest.json").is_file() else [])
    finally:
        for n in nodes:
            n.kill()
    links = plain[-1][1]["links"]
    print(json.dumps({
        "nodes": args.nodes, "links": len(links), "runs": args.runs,
        "all_reachable": all(r["reachable"] for r in links),
        "cli_wall_s_median": round(statistics.median(t for t, _ in plain), 2),
        "cli_wall_s_max": round(max(t for t, _ in plain), 2),
        "cli_wall_s_median_with_model": round(statistics.median(t for t, _ in model), 2) if model else None,
        "target_s": 5.0,
    }))


if __name__ == "__main__":
    main()
