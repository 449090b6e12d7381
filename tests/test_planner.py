"""Planner: MILP (literal and aggregated), DP and brute force agree; constructed cases."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from edgelite.errors import PlanInfeasible
from edgelite.planner import dp as plan_dp
from edgelite.planner import milp as plan_milp
from edgelite.planner.model import Device, Layer, Link, Problem, Span, predict, value
from edgelite.planner.solve import solution as solve

MiB = 2**20


def brute_force(p: Problem) -> tuple[float, list[Span]]:
    """Every sequence of distinct devices (client only first) and every cut into ranges."""
    best: tuple[float, list[Span]] = (math.inf, [])
    others = list(range(1, p.m))
    for r in range(0, len(others) + 1):
        for seq in itertools.permutations(others, r):
            for lead in ([(0,)] if p.client_first else [(0,), ()]):
                devs = [*lead, *seq]
                if not devs or len(devs) > p.n:
                    continue
                for cuts in itertools.combinations(range(1, p.n), len(devs) - 1):
                    bounds = [0, *cuts, p.n]
                    stages = [(d, bounds[i], bounds[i + 1] - 1) for i, d in enumerate(devs)]
                    v = value(p, stages)
                    if v < best[0]:
                        best = (v, stages)
    return best


def random_problem(rng: random.Random, identical: bool, objective: str) -> Problem:
    n, m = rng.randint(1, 8), rng.randint(1, 4)
    # (some layers take less on a `narrow` device: engine/matmul.c's products)
    base = Layer(flops=rng.uniform(1e6, 5e7), mem_bytes=rng.randint(50, 150) * MiB,
                 out_bytes=rng.choice([2304, 8192, 65536]), narrow_mem_bytes=rng.choice([0, 40 * MiB]))
    layers = tuple(base if identical else
                   Layer(rng.uniform(1e6, 5e7), rng.randint(50, 150) * MiB, base.out_bytes,
                         rng.choice([0, rng.randint(30, 50) * MiB]))
                   for _ in range(n))
    devices = tuple(Device(f"d{i}", rng.uniform(1e9, 2e10), rng.randint(1, 8) * 128 * MiB,
                           beta=rng.choice([0.5, 0.8, 1.0]), narrow=rng.random() < 0.5) for i in range(m))
    links = {(i, k): Link(rng.uniform(1, 30), rng.uniform(5, 200), rng.uniform(0, 3),
                          rng.choice([0, 0, 0.01, 0.05]))
             for i in range(m) for k in range(m) if i != k and rng.random() > 0.1}
    return Problem(layers, devices, links, client_first=rng.random() < 0.7,
                   client_reserved_bytes=rng.choice([0, 64 * MiB]), objective=objective)


def _solve_value(p: Problem, solver) -> float:
    try:
        plan = solver(p)
    except PlanInfeasible:
        return math.inf
    if plan.spans:
        assert plan.value == pytest.approx(value(p, plan.spans), rel=1e-9)
    return plan.value if plan.spans else math.inf


@pytest.mark.unit
def test_property_milp_dp_brute_force_agree() -> None:
    rng = random.Random(1234)
    checked = feasible = 0
    for case in range(240):
        identical = case % 2 == 0
        p = random_problem(rng, identical, "latency" if case % 3 else "throughput")
        truth, _ = brute_force(p)
        got = {"dp": _solve_value(p, lambda q: solve(q, "dp")),
               "literal": _solve_value(p, lambda q: solve(q, "milp-literal"))}
        if identical:
            got["aggregated"] = _solve_value(p, lambda q: solve(q, "milp-aggregated"))
            got["dp-general"] = _solve_value(p, lambda q: plan_dp.solve(q, general=True))
        for name, v in got.items():
            if math.isinf(truth):
                assert math.isinf(v), (case, name, v, p)
            else:
                assert v == pytest.approx(truth, rel=1e-6), (case, name, v, truth, p)
        checked += 1
        feasible += not math.isinf(truth)
    assert checked >= 200 and feasible >= 100


def _lossy_case(qos: bool) -> Problem:
    """Client C and phones A, B, D; memory needs C plus two phones. A and B are the fastest pair,
    but their link loses 5 % of packets; D is slower, its link to A is clean; B-D is down."""
    from edgelite.planner.model import Weights

    layer = Layer(flops=2e7, mem_bytes=100 * MiB, out_bytes=2304)
    devices = (Device("C", 1e9, 120 * MiB, beta=1.0), Device("A", 1e10, 1000 * MiB, beta=1.0),
               Device("B", 1e10, 1000 * MiB, beta=1.0), Device("D", 0.8e10, 1000 * MiB, beta=1.0))
    good, lossy = Link(5, 50), Link(1, 100, 0, 0.05)
    links = {(0, 1): good, (1, 0): good, (0, 2): good, (2, 0): good, (0, 3): good, (3, 0): good,
             (1, 2): lossy, (2, 1): lossy, (1, 3): Link(1, 100), (3, 1): Link(1, 100)}
    weights = Weights() if qos else Weights(w_q1=0, w_q2=0, w_q3=0)
    return Problem((layer,) * 12, devices, links, weights)


@pytest.mark.unit
def test_qos_term_alone_avoids_a_lossy_link() -> None:
    hops = lambda pl: {frozenset((a[0], b[0])) for a, b in itertools.pairwise(pl.spans)}  # noqa: E731
    blind = solve(_lossy_case(qos=False))
    aware = solve(_lossy_case(qos=True))
    assert frozenset((1, 2)) in hops(blind)  # without QoS the fast pair wins
    assert frozenset((1, 2)) not in hops(aware)  # with it, the 5 % link is avoided
    assert {d for d, _, _ in aware.spans} == {0, 1, 3}
    assert predict(_lossy_case(qos=True), aware.spans).qos < 1.0
    for solver in ("dp", "milp-literal"):
        assert solve(_lossy_case(qos=True), solver).value == pytest.approx(aware.value)


@pytest.mark.unit
def test_memory_forces_a_third_device() -> None:
    layer = Layer(flops=1e7, mem_bytes=100 * MiB, out_bytes=2304)
    devices = (Device("C", 1e10, 300 * MiB, beta=1.0), Device("A", 1e10, 500 * MiB, beta=1.0),
               Device("B", 1e9, 2000 * MiB, beta=1.0))
    link = Link(10, 50)
    links = {(i, k): link for i in range(3) for k in range(3) if i != k}
    plan = solve(Problem((layer,) * 9, devices, links))  # C holds 3, A 5: the 9th needs B
    assert {d for d, _, _ in plan.spans} == {0, 1, 2}
    small = Problem((layer,) * 8, devices, links)  # 8 layers fit on C + A: slow B stays out
    assert {d for d, _, _ in solve(small).spans} == {0, 1}


@pytest.mark.unit
@pytest.mark.parametrize("solver", ["dp", "milp-literal", "milp-aggregated"])
def test_a_device_that_runs_narrow_products_holds_more_layers(solver: str) -> None:
    """The same 9 layers take 100 MiB each, 60 on a device whose products are edgelite's: A
    then holds 8 of them and the slow B stays out."""
    layer = Layer(flops=1e7, mem_bytes=100 * MiB, out_bytes=2304, narrow_mem_bytes=60 * MiB)
    link = Link(10, 50)
    links = {(i, k): link for i in range(3) for k in range(3) if i != k}
    for narrow, used in ((False, {0, 1, 2}), (True, {0, 1})):
        devices = (Device("C", 1e10, 300 * MiB, beta=1.0),
                   Device("A", 1e10, 500 * MiB, beta=1.0, narrow=narrow),
                   Device("B", 1e9, 2000 * MiB, beta=1.0))
        plan = solve(Problem((layer,) * 9, devices, links), solver)
        assert {d for d, _, _ in plan.spans} == used
        assert all(b - a + 1 <= (8 if narrow and d == 1 else 5 if d == 1 else 3)
                   for d, a, b in plan.spans if d < 2)


@pytest.mark.unit
def test_infeasible_says_how_much_is_short() -> None:
    layer = Layer(flops=1e7, mem_bytes=100 * MiB, out_bytes=2304)
    devices = (Device("C", 1e10, 200 * MiB, beta=1.0), Device("A", 1e10, 300 * MiB, beta=1.0))
    p = Problem((layer,) * 8, devices, {(0, 1): Link(1, 10), (1, 0): Link(1, 10)})
    with pytest.raises(PlanInfeasible, match=r"need 800 MiB.*offer 500 MiB: 300 MiB short.*C \(200"):
        solve(p)


@pytest.mark.unit
def test_unreachable_device_is_not_used() -> None:
    layer = Layer(flops=1e8, mem_bytes=10 * MiB, out_bytes=2304)
    devices = (Device("C", 1e9, 1000 * MiB), Device("fast-but-cut-off", 1e12, 1000 * MiB))
    plan = solve(Problem((layer,) * 4, devices, {}))
    assert plan.spans == [(0, 0, 3)]


@pytest.mark.unit
def test_solver_reports_status() -> None:
    plan = solve(_lossy_case(qos=True), "milp-aggregated")
    assert plan.status == "optimal" and plan.solver == "highs-milp-aggregated"
    assert plan_milp.available()


@pytest.mark.unit
def test_solve_types_the_plan_with_names_and_addresses() -> None:
    from edgelite.ids import NodeAddr
    from edgelite.planner.solve import solve as typed_solve

    layer = Layer(flops=1e9, mem_bytes=100, out_bytes=4096)
    devices = (Device("client", 1e9, 10_000), Device("a", 1e12, 10_000, addr=NodeAddr("h", 1)))
    links = {(0, 1): Link(1.0, 100.0), (1, 0): Link(1.0, 100.0)}
    plan = typed_solve(Problem((layer,) * 4, devices, links, client_first=False))
    assert [(s.device, s.first, s.last, s.addr) for s in plan.stages] == [("a", 0, 3, NodeAddr("h", 1))]
    assert plan.remote == plan.stages and plan.local is None
    assert plan.to_json()["stages"][0]["addr"] == "h:1"
    assert plan.predicted is not None and plan.predicted.total > 0


@pytest.mark.unit
def test_a_stages_hop_is_the_links_time_and_its_qos_charge_apart() -> None:
    """A 6 ms link with 20 ms of jitter and 3 % loss: the stage's hop in is its latency and
    transfer (what a token waits), the planner's charge for the jitter and loss beside it (it
    showed 99 ms for such a link before)."""
    from edgelite.planner.solve import solve as typed_solve

    layer = Layer(flops=1e9, mem_bytes=100, out_bytes=4096)
    devices = (Device("client", 1e8, 10_000), Device("a", 1e12, 10_000))
    link = Link(6.0, 100.0, jitter_ms=20.0, loss=0.03)
    plan = typed_solve(Problem((layer,) * 4, devices, {(0, 1): link, (1, 0): link}, client_first=False))
    stage = plan.stages[0]
    assert 6.0 <= stage.hop_in_ms < 8.0 and stage.hop_qos_ms > 50.0, stage
    assert plan.to_json()["stages"][0]["hop_qos_ms"] == round(stage.hop_qos_ms, 4)


@pytest.mark.unit
def test_a_client_short_of_room_for_layer_0_leaves_every_layer_to_the_nodes() -> None:
    """Client-first only where the client has room: a client that cannot hold layer 0 gets a
    plan without it (the nodes hold every layer), not an error; one that can, keeps it."""
    from edgelite.planner.solve import room_for_layer_0

    layer = Layer(flops=1e8, mem_bytes=45 * MiB, out_bytes=8192)
    links = {(0, 1): Link(1.0, 100.0), (1, 0): Link(1.0, 100.0)}
    for client_mb, has_layer_0 in ((40, False), (400, True)):
        devices = (Device("phone", 1e10, client_mb * MiB, beta=1.0),
                   Device("node", 1e10, 1000 * MiB, beta=1.0))
        p = room_for_layer_0(Problem((layer,) * 8, devices, links, client_reserved_bytes=4 * MiB))
        plan = solve(p)
        assert (plan.spans[0][0] == 0) == has_layer_0, plan.spans
        assert p.client_first == has_layer_0


@pytest.mark.engine
def test_a_plan_takes_smaller_prompt_chunks_where_memory_is_short(exported) -> None:
    """Where the layers do not fit beside a 256-token chunk's scratch, the plan takes the
    largest chunk that fits (Plan.max_chunk) instead of failing; with room it sets none; with
    too little even for the smallest, it says so naming that chunk."""
    import dataclasses

    from edgelite import manifest as mf
    from edgelite.planner.solve import plan

    m = mf.load(exported["llama"])
    m = dataclasses.replace(
        m, layers=[dataclasses.replace(e, resident_bytes=40 * MiB, scratch_bytes=64 * MiB,
                                       narrow_resident_bytes=0, narrow_scratch_bytes=0) for e in m.layers],
        embed=dataclasses.replace(m.embed, resident_bytes=MiB, load_peak_bytes=0, narrow_resident_bytes=0),
        head=dataclasses.replace(m.head, resident_bytes=MiB, load_peak_bytes=0, narrow_resident_bytes=0),
        range_bytes=0, narrow_range_bytes=0)
    assert m.scratch_for(256) == 64 * MiB and m.scratch_for(64) < 20 * MiB < m.scratch_for(256)
    layers = m.num_layers * 40 * MiB + m.kv_bytes(0, m.num_layers - 1, 512)

    def cluster(node_bytes: int, client_bytes: int = 24 * MiB) -> dict:
        return {"client": "c", "devices": [
            {"name": "c", "flops": 1e9, "memory_bytes": client_bytes, "beta": 1.0},
            {"name": "n", "flops": 1e10, "memory_bytes": node_bytes, "beta": 1.0}],
            "links": [{"src": a, "dst": b, "latency_ms": 1.0, "bandwidth_mbps": 100.0}
                      for a, b in (("c", "n"), ("n", "c"))]}

    chunks = (16, 64, 256)
    tight = cluster(layers + 20 * MiB)
    with pytest.raises(PlanInfeasible):
        plan(m, tight, kv_tokens=512)  # (a 256-token chunk only)
    fitted = plan(m, tight, kv_tokens=512, chunks=chunks)
    assert fitted.max_chunk == 64 and fitted.to_json()["max_chunk"] == 64
    assert [(s.device, s.first, s.last) for s in fitted.stages] == [("n", 0, m.num_layers - 1)]
    roomy = plan(m, cluster(layers + 100 * MiB, 100 * MiB), kv_tokens=512, chunks=chunks)
    assert roomy.max_chunk == 0 and "max_chunk" not in roomy.to_json()
    with pytest.raises(PlanInfeasible, match="with prompt chunks of 16 tokens, the smallest"):
        plan(m, cluster(layers + 2 * MiB), kv_tokens=512, chunks=chunks)


@pytest.mark.unit
def test_a_failover_keeps_layers_in_place_with_a_spare() -> None:
    """A lost node's range goes to a spare and the others keep theirs when that plan is within
    the slack of the best (an 8 B recovery moved GBs of layers otherwise); a spare too slow
    for it leaves the best plan."""
    from edgelite.planner.model import Plan, Stage
    from edgelite.planner.solve import in_place
    from edgelite.planner.solve import solve as typed_solve

    layer = Layer(flops=1e9, mem_bytes=100 * MiB, out_bytes=4096)
    link = Link(2.0, 100.0)

    def problem(spare_flops: float) -> Problem:
        devices = (Device("client", 1e10, 150 * MiB, beta=1.0), Device("a", 1e10, 500 * MiB, beta=1.0),
                   Device("c", 1e10, 500 * MiB, beta=1.0), Device("d", spare_flops, 500 * MiB, beta=1.0))
        links = {(i, k): link for i in range(4) for k in range(4) if i != k}
        return Problem((layer,) * 10, devices, links)

    before = Plan((Stage("client", 0, 0), Stage("a", 1, 3), Stage("b", 4, 6), Stage("c", 7, 9)),
                  "latency", "dp", "optimal")  # (b is lost)
    p = problem(1e10)
    best = typed_solve(p)
    kept = in_place(p, before, best, slack=0.15)
    assert [(s.device, s.first, s.last) for s in kept.stages] == [
        ("client", 0, 0), ("a", 1, 3), ("d", 4, 6), ("c", 7, 9)]
    assert kept.value_ms <= best.value_ms * 1.15 and kept.solver == "in place"
    slow = problem(1e8)  # a spare 100x slower: keeping the ranges costs far more than the slack
    assert in_place(slow, before, typed_solve(slow), slack=0.15).solver != "in place"
