"""Where a step's time went: per-stage timings carried in the step, summarised per hop."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepTrace:
    """Where one step's time went: the round trip seen by the client, and per stage the time
    running its layers and the time from the step's arrival there to its sending onward."""

    tokens: int
    rtt_us: int
    stages: tuple[tuple[int, int], ...]  # (compute_us, held_us) per stage, in chain order

    @property
    def hop_us(self) -> float:
        """Time per hop outside the stages (sockets, kernel, wake-ups, the client's loop)."""
        return (self.rtt_us - sum(h for _, h in self.stages)) / (len(self.stages) + 1)


def parse_trace(obj: Any, max_stages: int | None = None) -> tuple[tuple[int, int], ...] | None:
    """A step's per-stage timings, or None when they are missing or malformed (not a list of
    [int, int] pairs, or not fewer than max_stages of them). Nodes run this on every step with
    cold caches: a plain loop."""
    if not isinstance(obj, list) or (max_stages is not None and len(obj) >= max_stages):
        return None
    for t in obj:
        if not (isinstance(t, list) and len(t) == 2 and type(t[0]) is int and type(t[1]) is int):
            return None
    return tuple((t[0], t[1]) for t in obj)


def hop_summary(traces: list[StepTrace]) -> dict[str, float]:
    """Medians over decode steps (one token): per-hop overhead and where a step's time went."""
    dec = [t for t in traces if t.tokens == 1] or traces
    if not dec:
        return {}
    return {"steps": len(dec),
            "rtt_us": statistics.median(t.rtt_us for t in dec),
            "compute_us": statistics.median(sum(c for c, _ in t.stages) for t in dec),
            "stage_overhead_us": statistics.median(sum(h - c for c, h in t.stages) for t in dec),
            "hop_us": statistics.median(t.hop_us for t in dec)}
