"""Placement model: which device runs which decoder layers, and what that costs per token.

Pure functions over data (no I/O, no clock). Time unit: milliseconds. A plan is a sequence of
stages, each a distinct device with a contiguous layer range; the client (device 0) holds a prefix
of the layers or none, and runs embedding and head, so a token travels
client -> stage 1 -> ... -> stage k -> client (docs/architecture.md, Contracts: Plan).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from edgelite.errors import EdgeliteError
from edgelite.ids import NodeAddr


class Objective(StrEnum):
    """What a plan minimises: its one definition, which every solver reads (milp.py, dp.py)."""

    LATENCY = "latency"  # one token's time: the sum of its stages, hops and the QoS and complexity terms
    THROUGHPUT = "throughput"  # the slowest stage: the pipeline's rate with sessions in flight

    @classmethod
    def parse(cls, name: str) -> Objective:
        try:
            return cls(name)
        except ValueError:
            raise EdgeliteError(f"objective {name!r}: one of {', '.join(OBJECTIVES)}") from None

    @property
    def sums(self) -> bool:
        """True: the cost adds up along the pipeline (each term priced where it is spent);
        False: it is the pipeline's bottleneck (every stage's time bounded)."""
        return self is Objective.LATENCY

    def of(self, pr: Prediction) -> float:
        """The objective's value of a predicted plan, in ms."""
        return pr.total if self.sums else pr.bottleneck


OBJECTIVES = tuple(o.value for o in Objective)


@dataclass(frozen=True)
class Weights:
    w_c: float = 1.0  # ms per device used (complexity)
    w_q1: float = 10.0  # x jitter (ms)
    w_q2: float = 1.0  # x transfer time (ms) x loss
    w_q3: float = 10000.0  # x loss^2: a 5 % loss link costs 25 ms
    e_p: float = 0.3  # effective fraction of the nominal bandwidth


@dataclass(frozen=True)
class Device:
    name: str
    flops: float  # effective FLOP/s on the model's own shapes
    memory_bytes: int
    beta: float = 0.8  # fraction of memory the plan may use
    addr: NodeAddr | None = None  # where a node listens (None: the client itself)
    narrow: bool = False  # it runs edgelite's product operators: a layer holds Layer.narrow_mem_bytes


@dataclass(frozen=True)
class Link:
    latency_ms: float
    bandwidth_mbps: float
    jitter_ms: float = 0.0
    loss: float = 0.0


@dataclass(frozen=True)
class Layer:
    flops: float  # per token
    mem_bytes: int  # what the layer holds once loaded (measured) + its KV reserve
    out_bytes: int  # activation sent to the next stage, per token
    narrow_mem_bytes: int = 0  # the same on a `narrow` device (0: not measured, mem_bytes)

    def mem_on(self, d: Device) -> int:
        """What it takes on device d."""
        return (d.narrow and self.narrow_mem_bytes) or self.mem_bytes


@dataclass(frozen=True)
class HopCost:
    data: float  # latency + transfer
    qos: float  # jitter, loss x transfer, loss^2 terms

    @property
    def total(self) -> float:
        return self.data + self.qos


@dataclass(frozen=True)
class Problem:
    layers: tuple[Layer, ...]
    devices: tuple[Device, ...]  # devices[0] is the client
    links: dict[tuple[int, int], Link] = field(default_factory=dict)
    weights: Weights = Weights()
    client_first: bool = True  # the client holds layer 0 (privacy), as in the source method
    client_reserved_bytes: int = 0  # embedding + head live on the client
    objective: Objective = Objective.LATENCY  # (a name is taken too)
    client_fixed_flops: float = 0.0  # embedding + head per token: the same in every plan
    scratch_bytes: int = 0  # what running a prompt chunk takes beyond the layers, on any device
    # what a device's range of layers holds once however many it has (Manifest.range_bytes;
    # narrow: on a device running edgelite's product operators)
    range_bytes: int = 0
    narrow_range_bytes: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "objective", Objective.parse(self.objective))

    @property
    def n(self) -> int:
        return len(self.layers)

    @property
    def m(self) -> int:
        return len(self.devices)

    @property
    def identical(self) -> bool:
        return len(set(self.layers)) == 1

    def capacity(self, i: int) -> float:
        d = self.devices[i]
        return (d.beta * d.memory_bytes - self.scratch_bytes - self.range_on(d)
                - (self.client_reserved_bytes if i == 0 else 0))

    def range_on(self, d: Device) -> int:
        """What a range of layers holds once on device d (beside its layers)."""
        return (d.narrow and self.narrow_range_bytes) or self.range_bytes

    def mem(self, i: int, j: int) -> int:
        """What layer j takes on device i."""
        return self.layers[j].mem_on(self.devices[i])

    def compute_ms(self, i: int, j: int) -> float:
        return self.layers[j].flops / self.devices[i].flops * 1e3

    def hop(self, i: int, k: int, out_bytes: int) -> HopCost | None:
        """Cost of sending one token's activation from device i to k; None if unreachable."""
        if i == k:
            return HopCost(0.0, 0.0)
        link = self.links.get((i, k))
        if link is None or link.bandwidth_mbps <= 0:
            return None
        w = self.weights
        t = out_bytes / (w.e_p * link.bandwidth_mbps * 125.0)  # Mbit/s -> bytes per ms
        qos = w.w_q1 * link.jitter_ms + w.w_q2 * t * link.loss + w.w_q3 * link.loss ** 2
        return HopCost(link.latency_ms + t, qos)

    def hop_ms(self, i: int, k: int, out_bytes: int) -> float:
        h = self.hop(i, k, out_bytes)
        return math.inf if h is None else h.total


Span = tuple[int, int, int]  # a stage inside the solvers: (device index, first layer, last layer)


@dataclass
class Solution:
    """What a solver returns (spans over device indices); solve.py makes it a Plan."""

    spans: list[Span]
    objective: str
    value: float  # the objective's value in ms
    solver: str
    status: str  # optimal | time_limit (gap ...) | ...
    gap: float = 0.0
    solve_ms: float = 0.0


@dataclass
class Prediction:
    total: float
    compute: float
    data: float
    qos: float
    complexity: float
    bottleneck: float  # the slowest stage (throughput objective)
    per_stage: list[dict[str, Any]]
    expected: float = math.inf  # wall ms/token: compute + data + the client's embedding and head


def check_spans(p: Problem, stages: list[Span]) -> None:
    """A valid plan: contiguous cover of all layers, distinct devices, client only first."""
    expect, seen = 0, set()
    for pos, (d, a, b) in enumerate(stages):
        if a != expect or b < a or d in seen or (d == 0 and pos != 0):
            raise ValueError(f"invalid stages {stages}")
        seen.add(d)
        expect = b + 1
    if expect != p.n:
        raise ValueError(f"stages {stages} do not cover layers 0-{p.n - 1}")


def predict(p: Problem, stages: list[Span]) -> Prediction:
    """ms per token of a plan, split into compute, data, QoS and complexity (math.inf if a hop
    is unreachable or memory does not fit)."""
    check_spans(p, stages)
    rows, compute, data, qos = [], 0.0, 0.0, 0.0
    prev, client_ms, stage_times = 0, 0.0, []
    for d, a, b in stages:
        mem = sum(p.mem(d, j) for j in range(a, b + 1))
        c = sum(p.compute_ms(d, j) for j in range(a, b + 1))
        hop = p.hop(prev, d, p.layers[max(a - 1, 0)].out_bytes)
        if hop is None or mem > p.capacity(d):
            return Prediction(math.inf, math.inf, math.inf, math.inf, math.inf, math.inf, [])
        rows.append({"device": p.devices[d].name, "first_layer": a, "last_layer": b,
                     "compute_ms": c, "hop_in_ms": hop.data, "hop_qos_ms": hop.qos})
        compute, data, qos, prev = compute + c, data + hop.data, qos + hop.qos, d
        if d == 0:
            client_ms = c
        else:
            stage_times.append(c + hop.total)
    back = p.hop(prev, 0, p.layers[-1].out_bytes)
    if back is None:
        return Prediction(math.inf, math.inf, math.inf, math.inf, math.inf, math.inf, [])
    data, qos = data + back.data, qos + back.qos
    complexity = p.weights.w_c * len(stages)
    bottleneck = max([client_ms + back.total, *stage_times])
    fixed = p.client_fixed_flops / p.devices[0].flops * 1e3
    return Prediction(compute + data + qos + complexity, compute, data, qos, complexity,
                      bottleneck, rows, compute + data + fixed)


def value(p: Problem, stages: list[Span]) -> float:
    return p.objective.of(predict(p, stages))


@dataclass(frozen=True)
class Stage:
    """One device's part of a plan: decoder layers first..last, and what the plan predicts for
    them. `addr` None: the client itself runs these layers."""

    device: str
    first: int
    last: int
    addr: NodeAddr | None = None
    compute_ms: float = 0.0
    hop_in_ms: float = 0.0  # the link into this stage: latency and transfer, what it takes
    hop_qos_ms: float = 0.0  # what the planner charges on top for its jitter and loss (not time)

    @property
    def layers(self) -> range:
        return range(self.first, self.last + 1)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "addr": None if self.addr is None else str(self.addr),
                "first_layer": self.first, "last_layer": self.last,
                "compute_ms": round(self.compute_ms, 4), "hop_in_ms": round(self.hop_in_ms, 4),
                "hop_qos_ms": round(self.hop_qos_ms, 4)}


@dataclass(frozen=True)
class Plan:
    """Where each decoder layer runs, how the plan was found, and what it predicts per token
    (ms). The stages are in chain order; the client runs embedding and head either way."""

    stages: tuple[Stage, ...]
    objective: str
    solver: str
    status: str
    value_ms: float = 0.0
    solve_ms: float = 0.0
    predicted: Prediction | None = None
    # when every layer stays on the client although there are nodes: the expected ms/token of
    # the best plan that gives the nodes at least one layer (inf: no node can hold one)
    with_nodes_ms: float | None = None
    # the most tokens a step may carry (prompts go in chunks of at most this), the chunk whose
    # scratch the plan counted; 0: the manifest's SCRATCH_CHUNK, which nodes assume
    max_chunk: int = 0

    @property
    def remote(self) -> tuple[Stage, ...]:
        """The stages that run on nodes (not on the client)."""
        return tuple(s for s in self.stages if s.addr is not None)

    @property
    def local(self) -> Stage | None:
        """The client's own stage, when the plan gives it layers."""
        return next((s for s in self.stages if s.addr is None), None)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"objective": self.objective, "solver": self.solver,
                               "status": self.status, "solve_ms": round(self.solve_ms, 2),
                               "value_ms": round(self.value_ms, 4),
                               "stages": [s.to_json() for s in self.stages]}
        pr = self.predicted
        if pr is not None:
            out["predicted_ms"] = {"total": round(pr.total, 4), "compute": round(pr.compute, 4),
                                   "data": round(pr.data, 4), "qos": round(pr.qos, 4),
                                   "complexity": round(pr.complexity, 4),
                                   "bottleneck": round(pr.bottleneck, 4)}
            out["expected_ms_per_token"] = round(pr.expected, 4)
        if self.with_nodes_ms is not None:
            out["with_nodes_ms_per_token"] = (None if math.isinf(self.with_nodes_ms)
                                              else round(self.with_nodes_ms, 4))
        if self.max_chunk:
            out["max_chunk"] = self.max_chunk
        return out
