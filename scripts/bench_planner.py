"""Planner solve times on random phone clusters (identical Llama-like layers, latency objective).

For each size, >= 10 random instances: the aggregated HiGHS MILP (must prove optimality) and the
exact subset DP, cross-checked against each other. Prints one JSON object.
Usage: python scripts/bench_planner.py [--instances 10]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from edgelite.planner.model import Device, Layer, Link, Problem
from edgelite.planner.solve import solution as solve

MiB = 2**20


def instance(rng: random.Random, n: int, m: int) -> Problem:
    # a 7B-class layer: ~0.4 GFLOP/token, ~200 MiB with KV reserve, 8 KiB activation per token
    layer = Layer(flops=4e8, mem_bytes=200 * MiB, out_bytes=8192)
    devices = tuple(Device(f"phone{i}", rng.uniform(5e9, 6e10), rng.choice([4, 6, 8, 12]) * 1024 * MiB,
                           beta=0.7) for i in range(m))
    links = {}
    for i in range(m):
        for k in range(m):
            if i != k and rng.random() > 0.05:
                links[i, k] = Link(rng.uniform(2, 30), rng.uniform(10, 150), rng.uniform(0, 4),
                                   rng.choice([0, 0, 0, 0.01, 0.03]))
    return Problem((layer,) * n, devices, links)


def run(n: int, m: int, count: int, rng: random.Random) -> dict:
    milp_ms, dp_ms, statuses, mismatches = [], [], [], 0
    for _ in range(count):
        p = instance(rng, n, m)
        a = solve(p, "milp-aggregated", time_limit_s=30)
        b = solve(p, "dp")
        milp_ms.append(a.solve_ms)
        dp_ms.append(b.solve_ms)
        statuses.append(a.status)
        mismatches += abs(a.value - b.value) > 1e-6 * max(1.0, abs(b.value))
    return {"n": n, "m": m, "instances": count,
            "milp_median_ms": round(statistics.median(milp_ms), 1),
            "milp_max_ms": round(max(milp_ms), 1),
            "milp_all_proven_optimal": all(s == "optimal" for s in statuses),
            "dp_median_ms": round(statistics.median(dp_ms), 1),
            "dp_max_ms": round(max(dp_ms), 1),
            "milp_dp_objective_mismatches": mismatches}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instances", type=int, default=10)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    sizes = [(32, 8), (80, 16)]
    res = [run(n, m, args.instances, rng) for n, m in sizes]
    print(json.dumps({"results": res,
                      "targets": {"n32_m8_milp_median_ms": 100, "n80_m16_milp_median_ms": 1500,
                                  "n80_m16_dp_median_ms": 150}}, indent=1))


if __name__ == "__main__":
    main()
