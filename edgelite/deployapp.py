"""Turn --nodes (and --split, or a live probe and the planner) into a deployed cluster backend."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from edgelite import manifest as mf
from edgelite.cluster import Assignment, ClusterBackend, in_order, open_cluster, parse_nodes, parse_split
from edgelite.clusterspec import problem_from
from edgelite.planner import Plan, Problem, solve
from edgelite.probeapp import client_memory, cluster_spec, cluster_token, probe
from edgelite.routes import parse_routes

log = logging.getLogger(__name__)


def assignment_of(p: Problem, plan: Plan, addrs: list[tuple[str, int]]) -> Assignment:
    """Plan stages (device indexes of the problem) -> stages over the --nodes list."""
    index = {f"{h}:{port}": i for i, (h, port) in enumerate(addrs)}
    return [(None if d == 0 else index[p.devices[d].name], a, b) for d, a, b in plan.stages]


async def plan_live(args: argparse.Namespace, manifest: mf.Manifest,
                    addrs: list[tuple[str, int]]) -> tuple[Problem, Plan, dict[str, Any]]:
    """Probe every device and link, then solve: (problem, plan, the probe result)."""
    probed = await probe(addrs, cluster_token(args), manifest,
                         routes=parse_routes(getattr(args, "route", None)),
                         client_memory_bytes=client_memory(args))
    p = problem_from(manifest, cluster_spec(probed), getattr(args, "objective", "latency"),
                     client_first=not getattr(args, "no_client_first", False))
    return p, solve(p, getattr(args, "solver", "auto")), probed


async def connect_backend(args: argparse.Namespace,
                          manifest: mf.Manifest) -> tuple[ClusterBackend, dict[str, Any] | None]:
    """Deploy --split when given, else the planner's plan; (backend, the plan's JSON or None)."""
    from edgelite.planapp import plan_json

    token, addrs = cluster_token(args), parse_nodes(args.nodes)
    if args.split:
        assignment, shown = in_order(parse_split(args.split, manifest.num_layers, len(addrs))), None
    else:
        p, plan, _ = await plan_live(args, manifest, addrs)
        assignment, shown = assignment_of(p, plan, addrs), plan_json(p, plan)
        log.info("plan: %s", [(s["device"], s["first_layer"], s["last_layer"]) for s in shown["stages"]])
    backend = await open_cluster(manifest, addrs, assignment, token, threads=args.threads,
                                 routes=parse_routes(getattr(args, "route", None)))
    return backend, shown
