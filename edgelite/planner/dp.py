"""Exact dynamic programmes over device subsets (contiguous ranges, each device used once).

`solve_general` handles any layers and both objectives; its state is (next layer, devices used,
last device), so it is for small m. `solve_identical_latency` handles the common case of identical
decoder layers with the latency objective at m = 16: for a fixed set of devices the compute part
is a greedy fill (fastest first, within memory) and the hop part is a shortest Hamiltonian path
from the client through the set and back (Held-Karp, vectorised over subsets).
"""

from __future__ import annotations

import math
import time
from functools import cache

import numpy as np

from edgelite.planner.model import Problem, Solution, Span, value

INF = math.inf


def solve(p: Problem, general: bool = False) -> Solution:
    """general=True forces the (small-m) general DP even where the fast path applies."""
    t0 = time.perf_counter()
    if p.identical and p.objective.sums and not general:
        stages = solve_identical_latency(p)
    else:
        stages = solve_general(p)
    ms = (time.perf_counter() - t0) * 1e3
    if not stages:
        return Solution([], p.objective, INF, "dp", "infeasible", solve_ms=ms)
    return Solution(stages, p.objective, value(p, stages), "dp", "optimal", solve_ms=ms)


def _range_ok(p: Problem, d: int, a: int, b: int, mem_prefix: list[list[int]]) -> bool:
    return mem_prefix[d][b + 1] - mem_prefix[d][a] <= p.capacity(d)


def solve_general(p: Problem) -> list[Span]:
    n, m, lat = p.n, p.m, p.objective.sums
    mem = [[0, *np.cumsum([p.mem(d, j) for j in range(n)]).tolist()] for d in range(m)]  # per device
    comp = [[0.0, *list(np.cumsum([p.compute_ms(d, j) for j in range(n)]))] for d in range(m)]
    w_c = p.weights.w_c

    def best_from(client_ms: float):
        @cache
        def f(j: int, mask: int, last: int) -> tuple[float, tuple[Span, ...]]:
            if j == n:
                back = p.hop_ms(last, 0, p.layers[-1].out_bytes)
                return (back if lat else client_ms + back), ()
            best: tuple[float, tuple[Span, ...]] = (INF, ())
            out = p.layers[j - 1].out_bytes if j else p.layers[0].out_bytes
            for d in range(1, m):
                if mask >> d & 1:
                    continue
                hop = p.hop_ms(last, d, out)
                if hop == INF:
                    continue
                for e in range(j, n):
                    if not _range_ok(p, d, j, e, mem):
                        break
                    rest, tail = f(e + 1, mask | 1 << d, d)
                    stage = comp[d][e + 1] - comp[d][j] + hop
                    cost = stage + w_c + rest if lat else max(stage, rest)
                    if cost < best[0]:
                        best = (cost, ((d, j, e), *tail))
            return best
        return f

    candidates = []
    lo = 1 if p.client_first else 0
    for c0 in range(lo, n + 1):  # layers on the client (a prefix)
        if c0 and not _range_ok(p, 0, 0, c0 - 1, mem):
            break
        client_ms = comp[0][c0]
        cost, tail = best_from(client_ms)(c0, 1, 0)
        head = ((0, 0, c0 - 1),) if c0 else ()
        if lat:
            cost += client_ms + (w_c if c0 else 0.0)
        candidates.append((cost, [*head, *tail]))
    if not candidates:
        return []
    cost, stages = min(candidates, key=lambda c: c[0])
    return stages if cost < INF else []


def _held_karp(p: Problem, out: int) -> tuple[np.ndarray, np.ndarray]:
    """Shortest client -> (every device of subset S) -> client path, for all S of devices 1..m-1.
    Returns (cost per mask, parent table for path recovery)."""
    k = p.m - 1
    hop = np.array([[p.hop_ms(i, j, out) for j in range(p.m)] for i in range(p.m)])
    size = 1 << k
    dp = np.full((size, k), INF)  # dp[mask, last]: path from client over mask, ending at last
    parent = np.full((size, k), -1, dtype=np.int64)
    for d in range(k):
        dp[1 << d, d] = hop[0, d + 1]
    masks = np.arange(size)
    pop = np.array([bin(x).count("1") for x in range(size)])
    for level in range(1, k):
        cur = masks[pop == level]
        for nxt in range(k):
            sel = cur[(cur >> nxt & 1) == 0]
            if not len(sel):
                continue
            cand = dp[sel] + hop[1:, nxt + 1][None, :]  # (masks, last)
            arg = cand.argmin(axis=1)
            val = cand[np.arange(len(sel)), arg]
            tgt = sel | (1 << nxt)
            better = val < dp[tgt, nxt]
            dp[tgt[better], nxt] = val[better]
            parent[tgt[better], nxt] = arg[better]
    closed = dp + hop[1:, 0][None, :]
    return closed, parent


def _fill(p: Problem, members: list[int], lower: dict[int, int],
          cap: dict[int, int]) -> dict[int, int] | None:
    counts = dict(lower)
    left = p.n - sum(counts.values())
    if left < 0:
        return None
    for d in sorted(members, key=lambda d: p.compute_ms(d, 0)):
        take = min(cap[d] - counts[d], left)
        counts[d] += take
        left -= take
    return counts if left == 0 else None


def solve_identical_latency(p: Problem) -> list[Span]:
    layer, k, w_c = p.layers[0], p.m - 1, p.weights.w_c
    cap = {d: min(p.n, int(p.capacity(d) // p.mem(d, 0))) if p.capacity(d) > 0 else 0
           for d in range(p.m)}
    unit = np.array([p.compute_ms(d, 0) for d in range(p.m)])
    if k == 0:
        return [(0, 0, p.n - 1)] if cap[0] >= p.n else []
    closed, parent = _held_karp(p, layer.out_bytes)
    size = 1 << k
    hops = closed.min(axis=1)
    hops[0] = 0.0  # nothing off the client: no hop
    best = (INF, None, None)
    client_opts = [True] if p.client_first else [True, False]
    for with_client in client_opts:
        if with_client and cap[0] < 1:
            continue
        # vectorised greedy fill over all subsets: every member gets 1, the rest fastest-first
        members = ((np.arange(size)[:, None] >> np.arange(k)[None, :]) & 1).astype(bool)
        count = members.sum(axis=1) + int(with_client)
        ok = np.ones(size, bool)
        for d in range(1, p.m):
            ok &= ~members[:, d - 1] | (cap[d] >= 1)
        left = p.n - count
        cost = count * w_c + hops + np.where(members, unit[1:][None, :], 0).sum(axis=1) \
            + (unit[0] if with_client else 0.0)
        # the rest of the layers go to the fastest members first, each up to its capacity
        for d in sorted(range(0 if with_client else 1, p.m), key=lambda d: unit[d]):
            room = cap[d] - 1
            inset = np.ones(size, bool) if d == 0 else members[:, d - 1]
            take = np.where(inset, np.clip(np.minimum(room, left), 0, None), 0)
            cost = cost + take * unit[d]
            left = left - take
        cost = np.where(ok & (left == 0), cost, INF)  # left < 0: more members than layers
        if not with_client:
            cost[0] = INF  # the client alone but holding nothing is no plan
        i = int(np.argmin(cost))
        if cost[i] < best[0]:
            best = (float(cost[i]), i, with_client)
    if best[1] is None:
        return []
    _, mask, with_client = best
    seq = _path(closed, parent, mask) if mask else []
    members = [d + 1 for d in range(k) if mask >> d & 1]
    counts = _fill(p, members + ([0] if with_client else []),
                   {d: 1 for d in members + ([0] if with_client else [])}, cap)
    assert counts is not None
    stages, first = [], 0
    for d in ([0] if with_client else []) + seq:
        stages.append((d, first, first + counts[d] - 1))
        first += counts[d]
    return stages


def _path(closed: np.ndarray, parent: np.ndarray, mask: int) -> list[int]:
    last = int(np.argmin(closed[mask]))
    seq = []
    while mask:
        seq.append(last + 1)
        prev = int(parent[mask, last])
        mask &= ~(1 << last)
        last = prev
    return seq[::-1]
