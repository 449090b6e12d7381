"""Probe a cluster: profile the client and every node, and measure every link, peer to peer.

Node -> node links are measured by the node at one end (the client asks it), so the matrix is
not measured through the client. Client <-> node links are measured by the client and taken as
symmetric (a phone client runs no server a node could probe). A node that cannot be reached is
a row marked unreachable, with the reason; the others are measured all the same.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from edgelite.config import ClientConfig, RuntimeConfig, WireLimits
from edgelite.engine.profile import host_profile, range_decode_seconds
from edgelite.errors import EdgeliteError
from edgelite.ids import NodeAddr
from edgelite.manifest import Manifest
from edgelite.net import messages as m
from edgelite.net.link import NodeLink
from edgelite.net.linkprobe import ProbeConfig, probe_peer, unreachable
from edgelite.net.routes import Routes, route
from edgelite.net.upload import push_files

log = logging.getLogger(__name__)

CLIENT = "client"
Progress = Callable[[str, int, int], None]
SMOOTHED = ("latency_ms", "jitter_ms", "jitter_p95_p50_ms", "jitter_trim_ms", "bandwidth_mbps",
            "loss")


@dataclass
class EMA:
    """Bias-corrected exponential moving average (as hivemind's PerformanceEMA)."""

    alpha: float = 0.3
    value: float = 0.0
    weight: float = 0.0

    def update(self, x: float) -> float:
        self.value = (1 - self.alpha) * self.value + self.alpha * x
        self.weight = (1 - self.alpha) * self.weight + self.alpha
        return self.value / self.weight


class _Steps:
    """Counts finished measurements for a progress callback."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress, self.total, self.count = progress, total, 0

    def done(self, what: str) -> None:
        self.count += 1
        if self.progress is not None:
            self.progress(what, self.count, self.total)


async def probe(addrs: list[NodeAddr], token: str, manifest: Manifest | None = None,
                cfg: ProbeConfig | None = None, repeat: int = 1, routes: Routes | None = None,
                client_memory_bytes: int | None = None, client_threads: int = 2,
                progress: Progress | None = None, client_matmul_kernel: bool = True,
                client_cfg: ClientConfig | None = None) -> dict[str, Any]:
    """{"devices": [...], "links": [...]} for the client and every node (README schema).
    Node -> node links are measured over `routes` (default: the client's address of the peer);
    `client_memory_bytes` caps what the plan may use on this device, which is timed with the
    onnxruntime threads it will run with (`client_threads`) and products
    (`client_matmul_kernel`: RuntimeConfig.matmul_kernel). `progress(what, done, total)` is
    told of each measurement as it finishes."""
    cfg, ccfg = cfg or ProbeConfig(), client_cfg or ClientConfig()
    n = len(addrs)
    steps = _Steps(progress, 1 + n + max(1, repeat) * (1 + n + n * (n - 1) // 2))
    fingerprint = manifest.fingerprint if manifest else None
    opened = await asyncio.gather(*(NodeLink.open(a, token, fingerprint, WireLimits(),
                                                  ccfg.connect_timeout_s) for a in addrs),
                                  return_exceptions=True)
    links = [x for x in opened if isinstance(x, NodeLink)]
    try:
        for x in opened:
            if isinstance(x, BaseException) and not isinstance(x, EdgeliteError):
                raise x
        prof = await asyncio.to_thread(_client_profile, manifest, client_threads, client_matmul_kernel)
        steps.done("profiled the client")
        client = {"name": CLIENT, "addr": None, "reachable": True, **prof}
        if client_memory_bytes is not None:
            client["memory_budget_bytes"] = client_memory_bytes
        devices = [client]
        for addr, x in zip(addrs, opened, strict=True):
            if isinstance(x, NodeLink):
                devices.append(await _profile(x, manifest, cfg, ccfg))
            else:
                devices.append({"name": str(addr), "addr": str(addr), "reachable": False,
                                "reason": str(x)})
            steps.done(f"profiled {addr}")
        for d in devices:
            if d.get("kernel") == "building":
                log.warning("%s: its kernel library is still being built (it started a moment ago): its "
                            "figures are onnxruntime's (more memory a layer); probe again in a few seconds",
                            d["name"])
        rounds = [await _links(links, token, cfg, routes or {}, steps) for _ in range(max(1, repeat))]
        rows = smooth(rounds)
        for addr, x in zip(addrs, opened, strict=True):
            if not isinstance(x, NodeLink):
                rows += _dead_rows(str(addr), [str(a) for a in addrs], str(x))
        return {"devices": devices, "links": rows}
    finally:
        await asyncio.gather(*(link.close() for link in links))


async def _profile(link: NodeLink, manifest: Manifest | None, cfg: ProbeConfig,
                   ccfg: ClientConfig) -> dict[str, Any]:
    """One node's profile; timed on the model's own layer 0 (its file is sent first, and stays
    cached there: a later deploy does not send it again)."""
    timeout = 10 * cfg.timeout_s + 30
    try:
        if manifest is not None:
            await push_files(link, manifest.root, manifest.layers[:1], ccfg.deploy_chunk_bytes,
                             ccfg.deploy_timeout_s)
        reply = await link.request(m.ProfileRequest(id=0, hidden_size=manifest.hidden_size if manifest
                                                    else 0, manifest=manifest and manifest.to_json()),
                                   m.ProfileReply, timeout)
    except EdgeliteError as exc:
        return {"name": link.name, "addr": link.name, "reachable": False, "reason": str(exc)}
    return {"name": link.name, "addr": link.name, "reachable": True, **reply.profile}


def _dead_rows(dead: str, names: list[str], reason: str) -> list[dict[str, Any]]:
    others = [CLIENT, *(n for n in names if n != dead)]
    row = unreachable(reason).to_json()
    return [{"src": a, "dst": b, **row} for o in others for a, b in ((o, dead), (dead, o))]


async def _links(nodes: list[NodeLink], token: str, cfg: ProbeConfig, routes: Routes,
                 steps: _Steps) -> list[dict[str, Any]]:
    """Small-packet phase for every directed link at once; then bulk transfers one node pair
    at a time (links share the air), each measuring both directions."""
    small, bulk = replace(cfg, bulk=False), replace(cfg, small=False)
    timeout = 10 * cfg.timeout_s + 30
    pairs = [(a, b, route(routes, a.addr, b.addr)) for a in nodes for b in nodes if a is not b]
    direct = await asyncio.gather(*(probe_peer(n.addr, token, small) for n in nodes))
    peer = await asyncio.gather(*(_node_probe(a, via, small, timeout) for a, _, via in pairs))
    steps.done("latency, jitter and loss of every link")
    rates: dict[tuple[str, str], dict[str, Any]] = {}
    for n in nodes:
        _rates(rates, CLIENT, n.name, (await probe_peer(n.addr, token, bulk)).to_json())
        steps.done(f"bandwidth client <-> {n.name}")
    for a, b, via in pairs:
        if (a.name, b.name) not in rates:  # one probe per pair: a measures a -> b and b -> a
            _rates(rates, a.name, b.name, await _node_probe(a, via, bulk, timeout))
            steps.done(f"bandwidth {a.name} <-> {b.name}")
    rows = []
    for n, st in zip(nodes, direct, strict=True):
        for src, dst in ((CLIENT, n.name), (n.name, CLIENT)):
            rows.append({"src": src, "dst": dst, **_merge(st.to_json(), rates[src, dst])})
    for (a, b, _), st in zip(pairs, peer, strict=True):
        rows.append({"src": a.name, "dst": b.name, **_merge(st, rates[a.name, b.name])})
    return rows


def _merge(small: dict[str, Any], bulk: dict[str, Any]) -> dict[str, Any]:
    if not small["reachable"]:
        return small
    if not bulk["reachable"]:
        return bulk
    # one direction per row: the reverse is the other row's bandwidth_mbps
    row = {**small, "bandwidth_mbps": bulk["bandwidth_mbps"]}
    row.pop("bandwidth_back_mbps", None)
    return row


def _rates(out: dict[tuple[str, str], dict[str, Any]], a: str, b: str, bulk: dict[str, Any]) -> None:
    out[a, b] = bulk
    out[b, a] = {**bulk, "bandwidth_mbps": bulk.get("bandwidth_back_mbps", math.nan)}


async def _node_probe(a: NodeLink, via: NodeAddr, cfg: ProbeConfig, timeout: float) -> dict[str, Any]:
    try:
        reply = await a.request(m.ProbeLink(id=0, peer=via, config=asdict(cfg)), m.LinkReport,
                                timeout)
    except EdgeliteError as exc:
        return unreachable(f"{a.name} could not probe: {exc}").to_json()
    return reply.link


def smooth(rounds: list[list[dict[str, Any]]], alpha: float = 0.3) -> list[dict[str, Any]]:
    """Merge repeated link rows: each metric a bias-corrected EMA over the reachable rounds;
    `measured_at` of the newest, `samples` how many rounds reached the link."""
    state: dict[tuple[str, str], tuple[dict[str, Any], dict[str, EMA], int]] = {}
    for rows in rounds:
        for r in rows:
            key = (r["src"], r["dst"])
            row, emas, n = state.get(key, (r, {k: EMA(alpha) for k in SMOOTHED}, 0))
            if r["reachable"]:
                row = {**r, **{k: emas[k].update(r[k]) for k in SMOOTHED if not math.isnan(r[k])}}
                n += 1
            state[key] = (row, emas, n)
    return [{**row, "samples": n} for row, _, n in state.values()]


def _client_profile(manifest: Manifest | None, threads: int, matmul_kernel: bool = True) -> dict[str, Any]:
    """This device (the client) measured like a node: on the model's layer 0 when given, and
    whether it runs edgelite's product operators (what a layer then holds: the manifest's narrow
    figures)."""
    from edgelite.engine.layers import LayerRange, export_files
    from edgelite.engine.passes import linear

    cfg = RuntimeConfig(threads=threads, verify_hashes=False, matmul_kernel=matmul_kernel)
    prof = host_profile()
    if manifest is not None:
        prof["narrow_products"] = linear.narrow(cfg, manifest)
        layer = LayerRange(manifest, 0, 0, cfg, export_files(manifest, verify=False))
        try:
            secs = range_decode_seconds(layer)
        finally:
            layer.close()
        prof.update(flops=manifest.layers[0].flops_per_token / secs, flops_source="layer 0")
    return prof


def without(probed: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """A probe result with these devices (and their links) marked unreachable: a failover
    plans on the nodes left without measuring again."""
    gone = "lost since the probe"
    return {"devices": [{**d, "reachable": False, "reason": gone} if d["name"] in names else d
                        for d in probed["devices"]],
            "links": [{**r, "reachable": False} if r["src"] in names or r["dst"] in names else r
                      for r in probed["links"]]}


def cluster_spec(probed: dict[str, Any]) -> dict[str, Any]:
    """The planner's cluster description from a probe result (unreachable devices and links
    left out)."""
    devices = [{"name": d["name"], "addr": d["addr"], "flops": d.get("flops") or 1e9,
                "memory_bytes": _memory(d), "narrow": bool(d.get("narrow_products", False)),
                # a budget is a hard bound, and what the process holds already is measured:
                # the plan may use all of the rest (free memory alone keeps a margin)
                **({"beta": 1.0} if d.get("memory_budget_bytes") is not None else {})}
               for d in probed["devices"] if d.get("reachable", True)]
    links = [{"src": r["src"], "dst": r["dst"], "latency_ms": r["latency_ms"],
              "bandwidth_mbps": r["bandwidth_mbps"], "jitter_ms": _jitter(r),
              "loss": 0.0 if math.isnan(r["loss"]) else r["loss"]}
             for r in probed["links"] if r["reachable"]]
    return {"devices": devices, "links": links, "client": CLIENT}


def _jitter(row: dict[str, Any]) -> float:
    """The jitter the planner prices: the trimmed range where the probe measured one."""
    trim = row.get("jitter_trim_ms")
    return row["jitter_ms"] if trim is None or math.isnan(trim) else trim


def _memory(d: dict[str, Any]) -> int:
    """What a plan may use: the free memory, capped by the device's budget when it set one
    (less what its process holds already: the budget bounds the process)."""
    free = d.get("memory_available_bytes") or d.get("memory_total_bytes")
    budget = d.get("memory_budget_bytes")
    if budget is not None:
        budget = max(0, int(budget) - int(d.get("rss_bytes") or 0))
    known = [int(x) for x in (free, budget) if x is not None]
    return min(known) if known else 0
