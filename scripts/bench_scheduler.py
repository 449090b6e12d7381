"""Discrete-event simulation of an overloaded gateway: the three-queue scheduler vs FCFS.

Synthetic traces (Poisson arrivals in bursts at 1.2x the cluster's capacity, three user tiers)
is served twice by the same step-cost model: once by the priority scheduler, once by FCFS (the
same scheduler with every priority weight 0 and patience 0: strict arrival order). The last line
is JSON; its headline is the median over --seeds traces. Usage:
python scripts/bench_scheduler.py [--seeds 5] [--cycles 5] [--load 1.2] [--calm 0.4]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import replace

from edgelite.config import SchedulerConfig
from edgelite.serve.scheduler import Request, Scheduler

TIERS = (0, 1, 2)  # 2 = top
MIX = (0.5, 0.3, 0.2)
CFG = SchedulerConfig(context_limit=1024, patience_s=30.0, max_requests=16, max_step_tokens=1024,
                      kv_tokens=4800, max_preemptions=2)
FCFS = replace(CFG, a_prompt=0.0, a_output=0.0, a_decode=0.0, w_tier=0.0, patience_s=0.0)


def step_seconds(prefill_tokens: int, decode_batch: int) -> float:
    """A pipeline of phones: prefill costs per token, a decode step per token of each request
    (pipelined across stages, so a batch costs far less than its size times one)."""
    if prefill_tokens:
        return 0.02 + 0.0004 * prefill_tokens
    return 0.03 + 0.004 * decode_batch if decode_batch else 0.0


def trace(seed: int, cycles: int, burst_s: float, rate: float, load: float,
          calm: float) -> list[tuple[float, int, int, int]]:
    """Bursts of `load` x capacity for burst_s, each followed by as long at `calm` x capacity."""
    rng = random.Random(seed)
    t, out = 0.0, []
    while t < cycles * 2 * burst_s:
        busy = (t // burst_s) % 2 == 0
        t += rng.expovariate(rate * (load if busy else calm))
        tier = rng.choices(TIERS, MIX)[0]
        out.append((t, tier, rng.randint(20, 400), rng.randint(20, 200)))
    return out


def simulate(cfg: SchedulerConfig, arrivals: list[tuple[float, int, int, int]]) -> dict:
    s = Scheduler(cfg)
    reqs = [Request(f"r{i}", tier, p, o, t) for i, (t, tier, p, o) in enumerate(arrivals)]
    first: dict[str, float] = {}
    late: dict[str, int] = {}  # rid -> requests ahead of it when it became overdue
    now, i, preemptions, max_step = 0.0, 0, 0, 0.0
    while i < len(reqs) or s.finished_count < len(reqs):
        while i < len(reqs) and reqs[i].arrival <= now:
            s.submit(reqs[i])
            i += 1
        ahead = len(s.running) + len(s.preempted)
        for w in s.waiting(now):  # promotes requests past their deadline, as step() would
            if w.overdue and w.rid not in late:
                late[w.rid] = ahead + sum(1 for x in s.waiting() if x.overdue and x is not w)
        d = s.decide(now)
        if d.idle:
            now = reqs[i].arrival if i < len(reqs) else now + 0.01
            continue
        dt = step_seconds(sum(r.prompt_len for r in d.admit) + sum(r.context for r in d.resume),
                          len(d.decode))
        max_step = max(max_step, dt)
        preemptions += len(d.preempt)
        now += dt
        for r in d.admit + d.resume + d.decode:
            first.setdefault(r.rid, now)
            s.advance(r)
    max_out = max(r.max_output for r in reqs)
    out: dict = {"preemptions": preemptions, "max_step_s": round(max_step, 3)}
    for tier in TIERS:
        mine = [r for r in reqs if r.tier == tier]
        ttft = sorted(first[r.rid] - r.arrival for r in mine)
        waits = [(r.admitted_at or 0.0) - r.arrival for r in mine]
        # promotion happens at the first step at or after the deadline: one step of slack
        bounds = [s.deadline(r) - r.arrival + (1 + s.wait_bound_steps(late[r.rid], max_out))
                  * max_step if r.rid in late else s.deadline(r) - r.arrival for r in mine]
        out[f"tier{tier}"] = {
            "requests": len(mine),
            "ttft_p50_s": round(statistics.median(ttft), 3),
            "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 3),
            "max_wait_s": round(max(waits), 3),
            "max_wait_over_bound": round(max(w / b if b > 0 else float(w > 0)
                                             for w, b in zip(waits, bounds, strict=True)), 4),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5, help="traces 0..N-1; the headline is the median")
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--burst-s", type=float, default=60.0)
    ap.add_argument("--load", type=float, default=1.2, help="arrival rate / capacity in a burst")
    ap.add_argument("--calm", type=float, default=0.4, help="arrival rate / capacity between")
    args = ap.parse_args()
    # capacity: a full decode batch, mean output 110 tokens, plus the mean prefill
    per_req = 110 * step_seconds(0, CFG.max_requests) / CFG.max_requests + step_seconds(210, 0)
    top, low = f"tier{TIERS[-1]}", f"tier{TIERS[0]}"
    runs = []
    for seed in range(args.seeds):
        arrivals = trace(seed, args.cycles, args.burst_s, 1 / per_req, args.load, args.calm)
        prio, fcfs = simulate(CFG, arrivals), simulate(FCFS, arrivals)
        runs.append({"seed": seed, "requests": len(arrivals), "priority": prio, "fcfs": fcfs,
                     "speedup": round(fcfs[top]["ttft_p99_s"] / prio[top]["ttft_p99_s"], 2)})
    print(json.dumps({
        "load": args.load, "calm": args.calm, "cycles": args.cycles, "burst_s": args.burst_s,
        "config": {k: v for k, v in CFG.__dict__.items()},
        "traces": runs,
        "per_seed_speedups": [r["speedup"] for r in runs],
        "top_tier_p99_ttft_speedup_vs_fcfs": statistics.median(r["speedup"] for r in runs),
        "lowest_tier_max_wait_s": max(r["priority"][low]["max_wait_s"] for r in runs),
        "lowest_tier_wait_within_bound": all(r["priority"][low]["max_wait_over_bound"] <= 1.0
                                             for r in runs),
    }))


if __name__ == "__main__":
    main()
