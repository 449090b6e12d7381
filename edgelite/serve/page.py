"""The cluster's web page (`GET /` of `edgelite serve --http`) and what it shows
(`GET /v1/cluster`): the devices and the links between them as the client probed them, the
plan's stages with their predicted time and the nodes' measured one, the gateway's queues and
per-tier latency, and a chat box that streams through /v1/chat/completions.

The page is one static file in the package (page.html: its script and style inline, no build
step, nothing fetched from elsewhere), so any device on the LAN opens it with a browser.
"""

from __future__ import annotations

import asyncio
import logging
import math
from importlib import resources
from typing import Any, Protocol

from edgelite.errors import EdgeliteError
from edgelite.ids import NodeAddr
from edgelite.manifest import Manifest
from edgelite.planner.model import Plan
from edgelite.serve.gateway import Gateway

log = logging.getLogger(__name__)
LINK_FIELDS = ("latency_ms", "jitter_ms", "bandwidth_mbps", "loss")
DEVICE_FIELDS = ("name", "addr", "node", "flops", "cpu_count", "machine", "memory_total_bytes",
                 "memory_available_bytes", "rss_bytes", "reachable", "reason")


class Deployed(Protocol):
    """What the page reads of a deployed model (the library's LLM is one)."""

    manifest: Manifest
    probed: dict[str, Any] | None

    @property
    def plan(self) -> Plan | None: ...

    async def node_stats(self) -> dict[NodeAddr, dict[str, Any]]: ...


def page_html() -> bytes:
    return resources.files("edgelite.serve").joinpath("page.html").read_bytes()


def _number(v: Any) -> Any:
    """JSON has no NaN nor infinity: a figure not measured is null."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


async def cluster_view(llm: Deployed, gateway: Gateway, stats_timeout_s: float) -> dict[str, Any]:
    """What the page shows, now. The nodes' own figures are asked for within
    `stats_timeout_s` (a node that does not answer shows none)."""
    plan = llm.plan
    probed = llm.probed or {}
    try:
        nodes = await asyncio.wait_for(llm.node_stats(), stats_timeout_s)
    except (TimeoutError, EdgeliteError, OSError) as exc:
        log.info("cluster page: no node figures: %s", exc)
        nodes = {}
    stages = []
    for st in plan.stages if plan is not None else ():
        measured = nodes.get(st.addr) if st.addr is not None else None
        stages.append({"device": st.device, "addr": None if st.addr is None else str(st.addr),
                       "layers": [st.first, st.last],
                       "predicted_ms": round(st.compute_ms + st.hop_in_ms, 3),
                       "measured_ms_per_run": None if measured is None
                       else round(measured.get("ms_per_run", 0.0), 3),
                       "sessions": None if measured is None else measured.get("sessions")})
    figures = gateway.stats()
    tiers = figures.get("tiers", {})
    return {
        "model": {"name": llm.manifest.name, "weights": llm.manifest.weights,
                  "compute": llm.manifest.compute, "layers": llm.manifest.num_layers},
        "devices": [{k: _number(d.get(k)) for k in DEVICE_FIELDS if k in d}
                    for d in probed.get("devices", [])],
        "links": [{"src": ln.get("src"), "dst": ln.get("dst"),
                   **{k: _number(ln.get(k)) for k in LINK_FIELDS}}
                  for ln in probed.get("links", [])],
        "plan": {"stages": stages, "solver": None if plan is None else plan.solver,
                 "expected_ms_per_token": None if plan is None or plan.predicted is None
                 else round(plan.predicted.expected, 3)},
        "measured_ms_per_token": {t: v.get("itl_ms_p50") for t, v in tiers.items()},
        "gateway": {k: figures.get(k) for k in ("queues", "queues_by_tier", "tiers",
                                                 "tokens_per_s", "cancelled", "reconnects")
                    if k in figures},
        "ready": gateway.ready}
