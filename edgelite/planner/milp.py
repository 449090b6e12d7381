"""HiGHS MILPs for the placement model of planner.py (same objective, same plan shape).

- `solve_literal`: x[i,j] = layer j on device i, with transition variables; any layers; for small m.
- `solve_aggregated`: identical layers; integer layer counts per device, binary hop choices forming
  one tour client -> ... -> client (a single-commodity flow keeps it connected). Its size is O(m^2)
  and does not depend on n.

Memory rows are scaled to layer units (coefficients ~1): rows in bytes (~1e9) made HiGHS report
wrong "optimal" and false "infeasible" answers. `run()` returns OK even for infeasible models, so
the model status is read and reported as it is.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from edgelite.planner.model import Problem, Solution, Span, value


def available() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


_banner_lock = threading.Lock()
_banner_shown = False


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """HiGHS >= 1.16 prints a banner to file descriptor 1 when the first Highs object of a
    process is made, before any option can silence it; it would corrupt `--json` output."""
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def _highs(time_limit_s: float) -> Any:
    global _banner_shown
    import highspy

    with _banner_lock:
        if _banner_shown:
            h = highspy.Highs()
        else:
            with _quiet_stdout():
                h = highspy.Highs()
            _banner_shown = True
    h.silent()
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", 1e-9)
    h.setOptionValue("mip_abs_gap", 1e-9)
    h.setOptionValue("threads", 1)
    return h


def _status(h: Any) -> tuple[str, float, bool]:
    """(status text, relative gap, has a usable solution)."""
    import highspy

    st = h.getModelStatus()
    info = h.getInfo()
    gap = float(getattr(info, "mip_gap", 0.0) or 0.0)
    has = info.primal_solution_status == 2  # kSolutionStatusFeasible
    if st == highspy.HighsModelStatus.kOptimal:
        return "optimal", 0.0 if not math.isfinite(gap) else gap, has
    if st == highspy.HighsModelStatus.kInfeasible:
        return "infeasible", math.inf, False
    if st == highspy.HighsModelStatus.kTimeLimit:
        return f"time_limit (gap {gap:.2%})", gap, has
    return h.modelStatusToString(st), gap, has


def _binary(h: Any, obj: float = 0.0) -> Any:
    import highspy

    return h.addVariable(lb=0, ub=1, obj=obj, type=highspy.HighsVarType.kInteger)


def _finish(p: Problem, h: Any, solver: str, t0: float, stages_fn) -> Solution:
    status, gap, has = _status(h)
    ms = (time.perf_counter() - t0) * 1e3
    if not has:
        return Solution([], p.objective, math.inf, solver, status, gap, ms)
    stages = stages_fn(h.getSolution().col_value)
    return Solution(stages, p.objective, value(p, stages), solver, status, gap, ms)


def solve_literal(p: Problem, time_limit_s: float = 10.0) -> Solution:
    t0 = time.perf_counter()
    h = _highs(time_limit_s)
    n, m, lat = p.n, p.m, p.objective.sums
    unit = max(max(L.mem_bytes, L.narrow_mem_bytes) for L in p.layers)
    x = {(i, j): _binary(h, p.compute_ms(i, j) if lat else 0.0) for i in range(m) for j in range(n)}
    u = {i: _binary(h, p.weights.w_c if lat else 0.0) for i in range(m)}
    for j in range(n):
        h.addConstr(sum(x[i, j] for i in range(m)) == 1)
    for i in range(m):
        h.addConstr(sum(x[i, j] * (p.mem(i, j) / unit) for j in range(n))
                    <= p.capacity(i) / unit)
        for j in range(n):
            h.addConstr(u[i] >= x[i, j])
    if p.client_first:
        h.addConstr(x[0, 0] == 1)
    entries: dict[int, list[Any]] = {k: [] for k in range(m)}
    incoming: dict[int, list[Any]] = {k: [] for k in range(m)}  # (cost x var) terms for throughput
    for k in range(1, m):
        c = p.hop_ms(0, k, p.layers[0].out_bytes)
        if math.isinf(c):
            h.addConstr(x[k, 0] == 0)
        else:
            incoming[k].append(c * x[k, 0])
            if lat:
                h.changeColCost(x[k, 0].index, p.compute_ms(k, 0) + c)
        entries[k].append(x[k, 0])
    for i in range(1, m):
        c = p.hop_ms(i, 0, p.layers[-1].out_bytes)
        if math.isinf(c):
            h.addConstr(x[i, n - 1] == 0)
        else:
            incoming[0].append(c * x[i, n - 1])
            if lat:
                h.changeColCost(x[i, n - 1].index,
                                p.compute_ms(i, n - 1) + c + (p.hop_ms(0, i, p.layers[0].out_bytes)
                                                              if n == 1 else 0.0))
    for j in range(n - 1):
        for i in range(m):
            for k in range(m):
                if i == k:
                    continue
                c = p.hop_ms(i, k, p.layers[j].out_bytes)
                if math.isinf(c):
                    h.addConstr(x[i, j] + x[k, j + 1] <= 1)
                    continue
                y = _binary(h, c if lat else 0.0)
                h.addConstr(y >= x[i, j] + x[k, j + 1] - 1)
                entries[k].append(y)
                incoming[k].append(c * y)
    if entries[0]:
        h.addConstr(sum(entries[0]) == 0)  # the client holds a prefix only
    for k in range(1, m):
        h.addConstr(sum(entries[k]) <= 1)  # one contiguous range per device
    if not lat:
        T = h.addVariable(lb=0, obj=1.0)
        for i in range(m):
            h.addConstr(T >= sum(x[i, j] * p.compute_ms(i, j) for j in range(n)) + sum(incoming[i]))
    h.run()

    def stages(col: list[float]) -> list[Span]:
        owner = [max(range(m), key=lambda i: col[x[i, j].index]) for j in range(n)]
        out: list[Span] = []
        for j, d in enumerate(owner):
            if out and out[-1][0] == d:
                out[-1] = (d, out[-1][1], j)
            else:
                out.append((d, j, j))
        return out

    return _finish(p, h, "highs-milp-literal", t0, stages)


def solve_aggregated(p: Problem, time_limit_s: float = 10.0) -> Solution:
    """Identical layers: counts c[i], used u[i], hop choices z[i,k] forming one tour from the client."""
    import highspy

    if not p.identical:
        raise ValueError("the aggregated MILP needs identical layers")
    t0 = time.perf_counter()
    h = _highs(time_limit_s)
    n, m, lat = p.n, p.m, p.objective.sums
    layer = p.layers[0]
    unit_ms = [p.compute_ms(i, 0) for i in range(m)]
    fit = [max(0, min(n, int(p.capacity(i) // p.mem(i, 0)))) for i in range(m)]
    integer = highspy.HighsVarType.kInteger
    c = {i: h.addVariable(lb=0, ub=fit[i], obj=unit_ms[i] if lat else 0.0, type=integer)
         for i in range(m)}
    u = {i: _binary(h, p.weights.w_c if lat else 0.0) for i in range(m)}
    hop = {(i, k): p.hop_ms(i, k, layer.out_bytes) for i in range(m) for k in range(m) if i != k}
    z = {ik: _binary(h, cost if lat else 0.0) for ik, cost in hop.items() if math.isfinite(cost)}
    f = {ik: h.addVariable(lb=0, ub=m - 1) for ik in z if ik[1] != 0}
    w = _binary(h)  # any device besides the client is used
    h.addConstr(sum(c.values()) == n)
    for i in range(m):
        h.addConstr(c[i] <= n * u[i])
        h.addConstr(c[i] >= u[i])
    if p.client_first:
        h.addConstr(u[0] == 1)
    others = [u[k] for k in range(1, m)]
    for k in range(1, m):
        h.addConstr(sum(z[i, k] for i in range(m) if (i, k) in z) == u[k])
        h.addConstr(sum(z[k, i] for i in range(m) if (k, i) in z) == u[k])
        h.addConstr(w >= u[k])
        flow_in = sum(f[i, k] for i in range(m) if (i, k) in f)
        flow_out = sum(f[k, i] for i in range(1, m) if (k, i) in f)
        h.addConstr(flow_in - flow_out == u[k])
    h.addConstr(sum(z[0, k] for k in range(1, m) if (0, k) in z) == w)
    h.addConstr(sum(z[i, 0] for i in range(1, m) if (i, 0) in z) == w)
    if others:
        h.addConstr(w <= sum(others))
    for ik, var in f.items():
        h.addConstr(var <= (m - 1) * z[ik])
    if not lat:
        T = h.addVariable(lb=0, obj=1.0)
        for i in range(m):
            h.addConstr(T >= unit_ms[i] * c[i] + sum(hop[k, i] * z[k, i] for k in range(m)
                                                     if (k, i) in z))
    h.run()

    def stages(col: list[float]) -> list[Span]:
        counts = {i: round(col[c[i].index]) for i in range(m)}
        order, cur = [], 0
        for _ in range(m):
            nxt = [k for (i, k) in z if i == cur and k != 0 and col[z[i, k].index] > 0.5]
            if not nxt:
                break
            cur = nxt[0]
            order.append(cur)
        seq = ([0] if counts[0] else []) + order
        out, first = [], 0
        for d in seq:
            out.append((d, first, first + counts[d] - 1))
            first += counts[d]
        return out

    return _finish(p, h, "highs-milp-aggregated", t0, stages)
