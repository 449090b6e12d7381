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
from collections.abc import Iterable
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
    planned = {st.addr for st in plan.stages if st.addr is not None} if plan is not None else set()
    left_out = getattr(gateway.backend, "left_out", frozenset())  # (a failover backend's)
    idle = await _idle_answers(gateway, probed, set(nodes) | planned | set(left_out), stats_timeout_s)
    return {
        "model": {"name": llm.manifest.name, "weights": llm.manifest.weights,
                  "compute": llm.manifest.compute, "layers": llm.manifest.num_layers},
        "devices": [{**{k: _number(d.get(k)) for k in DEVICE_FIELDS if k in d},
                     **_now(d, nodes, planned, left_out, gateway.down, idle)}
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
        "ready": gateway.ready, "down": gateway.down}


async def _idle_answers(gateway: Gateway, probed: dict[str, Any], known: set[NodeAddr],
                        timeout_s: float) -> dict[tuple[str, int], bool]:
    """Whether each probed node outside the plan answers now (a handshake), within
    `timeout_s` (one that does not: False)."""
    answers = getattr(gateway.backend, "answers", None)  # (a failover backend's)
    seen = {(a.host, a.port) for a in known}
    addrs = []
    for d in probed.get("devices", []):
        try:
            addr = NodeAddr.parse(str(d.get("addr") or ""))
        except EdgeliteError:
            continue
        if (addr.host, addr.port) not in seen:
            addrs.append(addr)
    if answers is None or not addrs:
        return {}
    try:
        said = await asyncio.wait_for(asyncio.gather(*(answers(a) for a in addrs)), timeout_s)
    except TimeoutError:
        said = [False] * len(addrs)
    return {(a.host, a.port): bool(ok) for a, ok in zip(addrs, said, strict=True)}


def _now(device: dict[str, Any], nodes: dict[NodeAddr, dict[str, Any]], planned: set[NodeAddr],
         left_out: frozenset[NodeAddr], down: str | None,
         idle: dict[tuple[str, int], bool]) -> dict[str, Any]:
    """A probed node as it is now (the probe's own figures are from the start): whether it
    answers, and why not (left out after a loss, silent, or no plan at all)."""
    try:
        addr = NodeAddr.parse(str(device.get("addr") or ""))
    except EdgeliteError:
        return {}  # (the client itself)

    def has(addrs: Iterable[NodeAddr]) -> bool:
        return any((a.host, a.port) == (addr.host, addr.port) for a in addrs)

    if has(nodes):
        return {"reachable": True, "reason": None, "in_plan": has(planned)}
    if has(left_out):
        return {"reachable": False, "reason": "lost: the plan goes on without it", "in_plan": False}
    if down is not None:
        return {"reachable": None, "reason": f"no plan now: {down}", "in_plan": False}
    if has(planned):
        return {"reachable": False, "reason": "does not answer now", "in_plan": True}
    answered = idle.get((addr.host, addr.port))
    if answered is None:
        return {"in_plan": False}
    return {"in_plan": False, "reachable": answered, "reason": None if answered else "does not answer now"}
