"""The gateway's figures: counters, and recent latencies per tier (its stats and /metrics)."""

from __future__ import annotations

import itertools
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgelite.config import GatewayConfig
from edgelite.serve.scheduler import Scheduler


@dataclass
class TierStats:
    window: int
    ttft_ms: deque[float] = field(init=False)
    itl_ms: deque[float] = field(init=False)
    wait_ms: deque[float] = field(init=False)  # from arrival to admission (the queue's wait)
    preemptions: int = 0
    done: int = 0

    def __post_init__(self) -> None:
        self.ttft_ms, self.itl_ms = deque(maxlen=self.window), deque(maxlen=self.window)
        self.wait_ms = deque(maxlen=self.window)

    def to_json(self) -> dict[str, Any]:
        def pct(xs: deque[float], q: float) -> float:
            return round(float(np.percentile(xs, q)), 2) if xs else 0.0

        return {"done": self.done, "preemptions": self.preemptions,
                "ttft_ms_p50": pct(self.ttft_ms, 50), "ttft_ms_p99": pct(self.ttft_ms, 99),
                "itl_ms_p50": pct(self.itl_ms, 50), "itl_ms_p99": pct(self.itl_ms, 99),
                "queue_wait_ms_p50": pct(self.wait_ms, 50), "queue_wait_ms_p99": pct(self.wait_ms, 99),
                "itl_ms_mean": round(statistics.fmean(self.itl_ms), 2) if self.itl_ms else 0.0}


@dataclass
class Figures:
    cfg: GatewayConfig
    tiers: dict[int, TierStats] = field(default_factory=dict)
    cancelled: int = 0  # requests of clients that left before they finished
    # tokens of resumed requests whose KV came back from the stores, and that were computed
    swapped_tokens: int = 0
    recomputed_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose KV came from a stored prefix (reuse_prefixes)
    reconnects: int = 0  # times the plan was deployed again after a lost node
    rejoins: int = 0  # times nodes a recovery left out were planned in again
    reconnect_failures: int = 0
    tokens_total: int = 0  # tokens streamed to every client since the start
    token_times: deque[float] = field(init=False)  # the latest tokens' times
    step_sizes: deque[int] = field(init=False)  # requests each recent step ran together

    def __post_init__(self) -> None:
        self.token_times = deque(maxlen=self.cfg.latency_window)
        self.step_sizes = deque(maxlen=self.cfg.latency_window)

    def tier(self, tier: int) -> TierStats:
        return self.tiers.setdefault(tier, TierStats(self.cfg.latency_window))

    def token(self, at: float) -> None:
        self.tokens_total += 1
        self.token_times.append(at)

    def finished(self, tier: int, ttft_ms: float | None, token_times: list[float],
                 wait_ms: float | None = None) -> None:
        st = self.tier(tier)
        if ttft_ms is not None:
            st.ttft_ms.append(ttft_ms)
        if wait_ms is not None:
            st.wait_ms.append(wait_ms)
        st.itl_ms.extend(float(x) * 1e3 for x in np.diff(token_times))
        st.done += 1

    def tokens_per_s(self) -> float:
        """Tokens streamed per second over the last `rate_window_s`."""
        since = time.monotonic() - self.cfg.rate_window_s
        recent = sum(1 for _ in itertools.takewhile(lambda t: t >= since, reversed(self.token_times)))
        return round(recent / self.cfg.rate_window_s, 2)

    def to_json(self, s: Scheduler, user_tiers: set[int], recoveries: int) -> dict[str, Any]:
        queues = {"waiting": s.waiting(), "running": s.running, "preempted": s.preempted_list()}
        tiers = {0} | user_tiers | {r.tier for rs in queues.values() for r in rs}
        per_tier = {str(t): {q: sum(1 for r in rs if r.tier == t) for q, rs in queues.items()}
                    for t in sorted(tiers)}
        return {"queues": {q: len(rs) for q, rs in queues.items()}, "queues_by_tier": per_tier,
                "cancelled": self.cancelled, "reconnects": self.reconnects,
                "rejoins": self.rejoins,
                "recoveries": recoveries,  # planned again without a node (a failover backend's)
                "reconnect_failures": self.reconnect_failures,
                "kv_tokens": {"used": s.kv_used, "budget": s.cfg.kv_tokens,
                              "charged": sorted((r.held for r in s.running), reverse=True)},
                "batch": {"steps": len(self.step_sizes),
                          "mean": round(statistics.fmean(self.step_sizes), 2) if self.step_sizes else 0.0,
                          "max": max(self.step_sizes, default=0)},
                "tokens_total": self.tokens_total, "tokens_per_s": self.tokens_per_s(),
                "preemptions": sum(st.preemptions for st in self.tiers.values()),
                "resumed_tokens": {"swapped_in": self.swapped_tokens,
                                   "recomputed": self.recomputed_tokens},
                "prompt_tokens_reused": self.reused_tokens,
                "tiers": {str(t): st.to_json() for t, st in sorted(self.tiers.items())}}
