"""Solve a placement Problem into a typed Plan (pure: no I/O, no clock but the solve timer).

Dispatches to the HiGHS MILPs (milp.py) or the exact DPs (dp.py); without highspy the DP is
used and that is said once in the log. Memory shortfalls are found before any solver runs and
reported with how much is short, and where.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from typing import Any

from edgelite.errors import EdgeliteError, MissingDependency, PlanInfeasible
from edgelite.ids import NodeAddr
from edgelite.manifest import SCRATCH_CHUNK, Manifest
from edgelite.planner import dp, milp
from edgelite.planner.model import Plan, Problem, Solution, Stage, Weights, predict, value
from edgelite.planner.spec import KV_TOKENS, problem_from

log = logging.getLogger(__name__)
SOLVERS = ("auto", "milp", "milp-literal", "milp-aggregated", "dp")
MAX_IN_PLACE = 720  # the most ways of putting lost ranges on spares in_place tries
_said_no_highs = False


def precheck(p: Problem) -> None:
    """Raise PlanInfeasible (with how much memory is short, and where) before any solver runs."""
    if p.capacity(0) < 0:
        client = p.devices[0]
        raise PlanInfeasible(
            f"the client ({client.name}) must hold the embedding and the head, "
            f"{p.client_reserved_bytes / 2**20:.0f} MiB (with a load's transient), and a prompt chunk "
            f"{p.scratch_bytes / 2**20:.0f} MiB, but has {client.beta * client.memory_bytes / 2**20:.0f}"
            f" MiB to give (--client-memory-mb, less what the process holds): "
            f"{-p.capacity(0) / 2**20:.0f} MiB short")
    names = ", ".join(f"{d.name} ({max(0.0, p.capacity(i)) / 2**20:.0f} MiB usable)"
                      for i, d in enumerate(p.devices))
    # (a layer may take less on some devices: edgelite's product operators; count its least)
    need = sum(min(p.mem(i, j) for i in range(p.m)) for j in range(p.n))
    have = sum(max(0.0, p.capacity(i)) for i in range(p.m))
    if need > have:
        raise PlanInfeasible(f"the layers need {need / 2**20:.0f} MiB, the devices offer "
                             f"{have / 2**20:.0f} MiB: {(need - have) / 2**20:.0f} MiB short; "
                             f"considered {names}")
    biggest = [max(p.mem(i, j) for j in range(p.n)) for i in range(p.m)]
    if all(p.capacity(i) < biggest[i] for i in range(p.m)):
        raise PlanInfeasible(f"no device can hold one layer of {min(biggest) / 2**20:.0f} MiB; "
                             f"considered {names}")


def _no_highs(solver: str) -> bool:
    """True when the MILP cannot run; an explicit MILP request without highspy is an error."""
    global _said_no_highs
    if milp.available():
        return False
    if solver != "auto":
        raise MissingDependency(f"--solver {solver} needs HiGHS: pip install 'edgelite[plan]' "
                                f"(or use --solver dp, the exact DP)")
    if not _said_no_highs:
        log.warning("highspy is not installed: planning with the exact DP instead of the HiGHS "
                    "MILP (same optimum; pip install 'edgelite[plan]' for the MILP)")
        _said_no_highs = True
    return True


def solution(p: Problem, solver: str = "auto", time_limit_s: float = 10.0) -> Solution:
    """The solver's answer over device indices (for cross-checks); solve() types it."""
    if solver not in SOLVERS:
        raise EdgeliteError(f"unknown solver {solver!r}; one of {', '.join(SOLVERS)}")
    precheck(p)
    if solver == "dp" or _no_highs(solver):  # (an explicit MILP without highspy raises)
        sol = dp.solve(p)
    elif solver == "milp-literal" or (solver in ("auto", "milp") and not p.identical):
        sol = milp.solve_literal(p, time_limit_s)
    else:
        sol = milp.solve_aggregated(p, time_limit_s)
    if not sol.spans:
        raise PlanInfeasible(_no_fit(p, f"{sol.solver}: {sol.status}"))
    return sol


def _no_fit(p: Problem, how: str) -> str:
    """Why no placement fits though the bytes add up: each device holds whole layers."""
    means = [sum(p.mem(i, j) for j in range(p.n)) / p.n for i in range(p.m)]
    mean = means[0]
    fits = [max(0, int(p.capacity(i) // means[i])) for i in range(p.m)]
    held = ", ".join(f"{d.name} ~{k}" for d, k in zip(p.devices, fits, strict=True))
    return (f"no placement fits ({how}): each device holds whole layers of ~{mean / 2**20:.0f} MiB "
            f"(what a layer holds once loaded and its KV): {held}, {sum(fits)} of {p.n}; more "
            f"memory, another device, or a shorter --context would make room")


def typed(p: Problem, sol: Solution) -> Plan:
    """A solver's spans as a Plan: device names and addresses, and the per-stage prediction."""
    pr = predict(p, sol.spans)
    stages = tuple(Stage(p.devices[d].name, a, b, p.devices[d].addr, row["compute_ms"],
                         row["hop_in_ms"], row["hop_qos_ms"])
                   for (d, a, b), row in zip(sol.spans, pr.per_stage, strict=True))
    return Plan(stages, sol.objective, sol.solver, sol.status, sol.value, sol.solve_ms, pr)


def solve(p: Problem, solver: str = "auto", time_limit_s: float = 10.0) -> Plan:
    """The best plan. solver: auto | milp | milp-literal | milp-aggregated | dp."""
    return typed(p, solution(p, solver, time_limit_s))


def split_plan(ranges: list[tuple[int, int]], addrs: list[NodeAddr], n_layers: int) -> Plan:
    """A plan from explicit ranges (node i runs ranges[i]) without a probed cluster."""
    if len(ranges) != len(addrs):
        raise EdgeliteError(f"{len(ranges)} layer ranges for {len(addrs)} nodes")
    expect = 0
    for a, b in ranges:
        if a != expect or b < a:
            raise EdgeliteError(f"the layer ranges must cover layers 0-{n_layers - 1} in order; "
                                f"got {ranges}")
        expect = b + 1
    if expect != n_layers:
        raise EdgeliteError(f"the layer ranges cover layers 0-{expect - 1}, the model has "
                            f"0-{n_layers - 1}")
    stages = tuple(Stage(str(a), first, last, a) for a, (first, last) in zip(addrs, ranges, strict=True))
    return Plan(stages, "latency", "split", "given")


def in_place(p: Problem, before: Plan, best: Plan, slack: float) -> Plan:
    """`before`'s stages where their devices still are, each lost device's range on a device
    it did not use (a spare): that plan where its objective is within `slack` of `best`'s (a
    failover then moves the lost node's layers only, not most of them), else `best`."""
    index = {d.name: i for i, d in enumerate(p.devices)}
    kept = [(index.get(s.device), s.first, s.last) for s in before.stages]
    lost = [k for k, (d, _, _) in enumerate(kept) if d is None]
    spares = [i for i in range(1, p.m) if i not in {d for d, _, _ in kept}]
    if not lost or len(lost) > len(spares) or math.perm(len(spares), len(lost)) > MAX_IN_PLACE:
        return best
    tries = []
    for chosen in itertools.permutations(spares, len(lost)):
        spans = [(d, a, b) for d, a, b in kept]
        for k, d in zip(lost, chosen, strict=True):
            spans[k] = (d, spans[k][1], spans[k][2])
        tries.append((value(p, spans), spans))  # (inf where a device's memory or a link fails)
    v, spans = min(tries, key=lambda t: t[0])
    if not math.isfinite(v) or v > best.value_ms * (1 + slack):
        return best
    log.info("the failover plan keeps the layers where they are (%.1f ms against the best %.1f)",
             v, best.value_ms)
    return dataclasses.replace(typed(p, Solution(spans, best.objective, v, "in place", "kept")),
                               max_chunk=best.max_chunk)


def plan(manifest: Manifest, cluster: dict[str, Any], objective: str = "latency",
         solver: str = "auto", client_first: bool = True, kv_tokens: int = KV_TOKENS,
         weights: Weights | None = None, chunks: tuple[int, ...] = (SCRATCH_CHUNK,),
         before: Plan | None = None, slack: float = 0.0) -> Plan:
    """Place a model's layers on a cluster (devices and links, as `edgelite probe` measures
    them or as cluster.json describes them). Reads only the manifest. `chunks`: the prompt
    chunk sizes a step may carry; where the layers do not fit beside the largest chunk's
    scratch, the plan takes the largest that fits (Plan.max_chunk: prompts then go in smaller
    chunks, slower to prefill). `before`: the plan running now (a failover), kept in place
    where that is within `slack` of the best (`in_place`)."""
    sizes = sorted(set(chunks), reverse=True) or [SCRATCH_CHUNK]
    short: PlanInfeasible | None = None
    for chunk in sizes:
        p = room_for_layer_0(problem_from(manifest, cluster, objective, weights, client_first,
                                          kv_tokens, chunk))
        try:
            best = solve(p, solver)
        except PlanInfeasible as exc:
            log.info("with prompt chunks of %d tokens: %s", chunk, exc)
            short = exc
            continue
        if chunk != SCRATCH_CHUNK:  # (what a node counts when told nothing: Load.max_chunk 0)
            best = dataclasses.replace(best, max_chunk=chunk)
        if before is not None:
            best = in_place(p, before, best, slack)
        if p.m == 1 or any(s.device != p.devices[0].name for s in best.stages):
            return best  # (the nodes run layers: by name, cluster.json devices have no address)
        return dataclasses.replace(best, with_nodes_ms=with_nodes_ms(p))
    if len(sizes) > 1:
        raise PlanInfeasible(f"{short} (with prompt chunks of {sizes[-1]} tokens, the smallest)")
    raise short  # type: ignore[misc]


def room_for_layer_0(p: Problem) -> Problem:
    """Client-first (layer 0 on the client, so that only hidden states cross the network)
    only where the client has room for it: else the nodes take every layer."""
    if not p.client_first or p.capacity(0) >= p.mem(0, 0):
        return p
    log.info("the client (%s) has %.0f MiB usable beyond the embedding and head, less than layer "
             "0's %.0f MiB: the nodes hold every layer (--client-memory-mb sets what the client "
             "may use)", p.devices[0].name, max(0.0, p.capacity(0)) / 2**20,
             p.mem(0, 0) / 2**20)
    return dataclasses.replace(p, client_first=False)


def with_nodes_ms(p: Problem) -> float:
    """Expected ms/token of the best plan that gives the nodes at least one layer (the client
    may hold all but one layer's bytes, beside its scratch); inf when no such plan fits. Says
    why a plan keeps every layer on the client."""
    total = sum(p.mem(0, j) for j in range(p.n))
    client = p.devices[0]
    memory = min(client.memory_bytes, int((total - 1 + p.client_reserved_bytes + p.scratch_bytes
                                           + p.range_on(client)) / client.beta))
    q = dataclasses.replace(p, devices=(dataclasses.replace(client, memory_bytes=memory),
                                        *p.devices[1:]))
    try:
        return predict(q, solution(q, "dp").spans).expected
    except PlanInfeasible:
        return math.inf
