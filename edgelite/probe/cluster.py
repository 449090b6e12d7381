"""`edgelite probe`: profile every node and measure every link, peer to peer.

Node -> node links are measured by the node at one end (the client asks it), so the matrix is
not measured through the client. Client <-> node links are measured by the client and taken as
symmetric (a phone client runs no server a node could probe).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
from dataclasses import replace
from typing import Any

from edgelite import manifest as mf
from edgelite.client.cluster import Cluster, NodeLink, Progress, parse_nodes
from edgelite.config import ClientConfig
from edgelite.errors import EdgeliteError
from edgelite.net.routes import Addr, Routes, parse_routes, route
from edgelite.probe import prober

CLIENT = "client"


def cluster_token(args: argparse.Namespace) -> str:
    token = getattr(args, "token", None) or os.environ.get("EDGELITE_TOKEN")
    if not token:
        raise EdgeliteError("the cluster token is needed: --token or EDGELITE_TOKEN "
                            "(each node prints it when it starts)")
    return token


async def probe(addrs: list[tuple[str, int]], token: str, manifest: mf.Manifest | None,
                cfg: prober.ProbeConfig | None = None, repeat: int = 1, routes: Routes | None = None,
                client_memory_bytes: int | None = None, client_threads: int = 2,
                progress: Progress | None = None) -> dict[str, Any]:
    """{"devices": [...], "links": [...]} for the client and every node (see README schema).
    Node -> node links are measured over `routes` (default: the client's address of the peer);
    `client_memory_bytes` caps what the plan may use on this device, which is timed with the
    onnxruntime threads it will run with (`client_threads`). `progress(what, done, total)` is
    told of each measurement as it finishes."""
    cfg = cfg or prober.ProbeConfig()
    n = len(addrs)
    steps = _Steps(progress, 1 + n + max(1, repeat) * (1 + n + n * (n - 1) // 2))
    cluster = Cluster(manifest or _NoModel(), token, ClientConfig())  # type: ignore[arg-type]
    await cluster.connect(addrs)
    try:
        hidden = manifest.hidden_size if manifest else 0
        timeout = 10 * cfg.timeout_s + 30
        prof = await asyncio.to_thread(_client_profile, manifest, client_threads)
        steps.done("profiled the client")
        client = {"name": CLIENT, "addr": None, **prof}
        if client_memory_bytes is not None:
            client["memory_budget_bytes"] = client_memory_bytes
        # one node at a time: nodes sharing a machine (tests, demo) would slow each other down
        if manifest is not None:  # time the model's own layer: each node gets layer 0's file
            for link in cluster.links:  # (cached there; a later deploy will not send it again)
                await cluster.push_files(link, manifest.layers[:1], None)
        req = {"type": "profile", "hidden_size": hidden, "layer": _layer_desc(manifest)}
        profiles = []
        for link in cluster.links:
            profiles.append(await link.request(req, timeout))
            steps.done(f"profiled {link.name}")
        devices = [client, *({"name": link.name, "addr": link.name,
                              **{k: v for k, v in prof.items() if k not in ("type", "id")}}
                             for link, prof in zip(cluster.links, profiles, strict=True))]
        rounds = [await _links(cluster, token, cfg, timeout, routes or {}, steps)
                  for _ in range(max(1, repeat))]
        return {"devices": devices, "links": smooth(rounds)}
    finally:
        await cluster.close()


async def _links(cluster: Cluster, token: str, cfg: prober.ProbeConfig, timeout: float,
                 routes: Routes, steps: _Steps) -> list[dict[str, Any]]:
    """Small-packet phase for every directed link at once; then bulk transfers one node pair
    at a time (links share the air), each measuring both directions."""
    small = replace(cfg, bulk=False)
    bulk = replace(cfg, small=False)
    nodes = cluster.links
    pairs = [(a, b, route(routes, a.name, b.name, b.addr)) for a in nodes for b in nodes if a is not b]
    direct = await asyncio.gather(*(prober.probe_peer(*n.addr, None, token, small) for n in nodes))
    peer = await asyncio.gather(*(_node_probe(a, via, small, timeout) for a, _, via in pairs))
    steps.done("latency, jitter and loss of every link")
    rates: dict[tuple[str, str], dict[str, Any]] = {}
    for n in nodes:
        _rates(rates, CLIENT, n.name, (await prober.probe_peer(*n.addr, None, token, bulk)).to_json())
        steps.done(f"bandwidth client <-> {n.name}")
    for a, b, via in pairs:
        if (a.name, b.name) not in rates:  # one probe per pair: a measures a -> b and b -> a
            _rates(rates, a.name, b.name, await _node_probe(a, via, bulk, timeout))
            steps.done(f"bandwidth {a.name} <-> {b.name}")
    rows = []
    for n, st in zip(nodes, direct, strict=True):
        for src, dst in ((CLIENT, n.name), (n.name, CLIENT)):
            rows.append(_row(src, dst, _merge(st.to_json(), rates[src, dst])))
    for (a, b, _), st in zip(pairs, peer, strict=True):
        rows.append(_row(a.name, b.name, _merge(st, rates[a.name, b.name])))
    return rows


class _Steps:
    """Counts finished measurements for a progress callback."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress, self.total, self.count = progress, total, 0

    def done(self, what: str) -> None:
        self.count += 1
        if self.progress is not None:
            self.progress(what, self.count, self.total)


def _merge(small: dict[str, Any], bulk: dict[str, Any]) -> dict[str, Any]:
    if not small["reachable"]:
        return small
    if not bulk["reachable"]:
        return bulk
    return {**small, "bandwidth_mbps": bulk["bandwidth_mbps"]}  # one direction per row


def _rates(out: dict[tuple[str, str], dict[str, Any]], a: str, b: str, bulk: dict[str, Any]) -> None:
    out[a, b] = bulk
    out[b, a] = {**bulk, "bandwidth_mbps": bulk.get("bandwidth_back_mbps", math.nan)}


async def _node_probe(a: NodeLink, via: Addr, cfg: prober.ProbeConfig, timeout: float) -> dict:
    try:
        reply = await a.request({"type": "probe_link", "host": via.host, "port": via.port,
                                 "udp_port": via.udp_port, "config": cfg.__dict__}, timeout)
    except EdgeliteError as exc:
        return prober.unreachable(f"{a.name} could not probe: {exc}").to_json()
    return reply["link"]


SMOOTHED = ("latency_ms", "jitter_ms", "jitter_p95_p50_ms", "jitter_trim_ms", "bandwidth_mbps",
            "loss")


def smooth(rounds: list[list[dict[str, Any]]], alpha: float = 0.3) -> list[dict[str, Any]]:
    """Merge repeated link rows: each metric a bias-corrected EMA over the reachable rounds;
    `measured_at` of the newest, `samples` how many rounds reached the link."""
    state: dict[tuple[str, str], tuple[dict[str, Any], dict[str, prober.EMA], int]] = {}
    for rows in rounds:
        for r in rows:
            key = (r["src"], r["dst"])
            row, emas, n = state.get(key, (r, {k: prober.EMA(alpha) for k in SMOOTHED}, 0))
            if r["reachable"]:
                row = {**r, **{k: emas[k].update(r[k]) for k in SMOOTHED if not math.isnan(r[k])}}
                n += 1
            state[key] = (row, emas, n)
    return [{**row, "samples": n} for row, _, n in state.values()]


def _row(src: str, dst: str, stats: dict[str, Any]) -> dict[str, Any]:
    return {"src": src, "dst": dst, **stats}


def _layer_desc(m: mf.Manifest | None) -> dict[str, Any] | None:
    """What a node needs to time the model's layer 0 (from its file cache, or a GEMV as big)."""
    if m is None:
        return None
    e = m.layers[0]
    return {"sha256": e.sha256, "flops_per_token": e.flops_per_token, "param_bytes": e.param_bytes,
            "hidden_size": m.hidden_size, "num_kv_heads": m.num_kv_heads, "head_dim": m.head_dim}


class _NoModel:
    fingerprint = None


def _client_profile(manifest: mf.Manifest | None, threads: int) -> dict[str, Any]:
    """This device (the client) measured like a node: on the model's layer 0 when given."""
    from edgelite.config import RuntimeConfig
    from edgelite.engine.runtime import LayerRange

    prof = prober.host_profile()
    if manifest is not None:
        m = manifest
        layer = LayerRange(m, 0, 0, RuntimeConfig(threads=threads, verify_hashes=False))
        secs = prober.layer_decode_seconds(layer.sessions[0], m.hidden_size, m.num_kv_heads,
                                           m.head_dim)
        prof.update(flops=m.layers[0].flops_per_token / secs, flops_source="layer 0")
    return prof


def cluster_spec(probed: dict[str, Any]) -> dict[str, Any]:
    """The planner's cluster description from a probe result (unreachable links left out)."""
    devices = [{"name": d["name"], "flops": d.get("flops") or 1e9, "memory_bytes": _memory(d)}
               for d in probed["devices"]]
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
    """What a plan may use: the free memory, capped by the device's budget when it set one."""
    free = d.get("memory_available_bytes") or d.get("memory_total_bytes")
    budget = d.get("memory_budget_bytes")
    known = [int(x) for x in (free, budget) if x is not None]
    return min(known) if known else 0


def client_memory(args: argparse.Namespace) -> int | None:
    mb = getattr(args, "client_memory_mb", None)
    return None if mb is None else int(mb * 2**20)


async def probe_args(args: argparse.Namespace, manifest: mf.Manifest | None) -> dict[str, Any]:
    """probe() with the CLI's flags (--nodes, --token, --route, --client-memory-mb, --repeat)."""
    return await probe(parse_nodes(args.nodes), cluster_token(args), manifest,
                       repeat=getattr(args, "repeat", 1),
                       routes=parse_routes(getattr(args, "route", None)),
                       client_memory_bytes=client_memory(args))


async def probe_cluster_spec(args: argparse.Namespace, manifest: mf.Manifest) -> dict[str, Any]:
    return cluster_spec(await probe_args(args, manifest))


def run_probe(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(probe_args(args, mf.load(args.model) if args.model else None))
