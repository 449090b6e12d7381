"""Turn --nodes (and --split, or a live probe and the planner) into a deployed cluster backend."""

from __future__ import annotations

import argparse
import logging
from contextlib import nullcontext
from typing import Any

from edgelite import manifest as mf
from edgelite.client.cluster import (
    Assignment,
    ClusterBackend,
    Progress,
    in_order,
    open_cluster,
    parse_nodes,
    parse_split,
)
from edgelite.net.routes import Routes, parse_routes
from edgelite.plan.model import Plan, Problem, solve
from edgelite.plan.spec import problem_from
from edgelite.probe.cluster import client_memory, cluster_spec, cluster_token, probe
from edgelite.probe.prober import ProbeConfig

log = logging.getLogger(__name__)


def assignment_of(p: Problem, plan: Plan, addrs: list[tuple[str, int]]) -> Assignment:
    """Plan stages (device indexes of the problem) -> stages over the --nodes list."""
    index = {f"{h}:{port}": i for i, (h, port) in enumerate(addrs)}
    return [(None if d == 0 else index[p.devices[d].name], a, b) for d, a, b in plan.stages]


async def plan_cluster(manifest: mf.Manifest, addrs: list[tuple[str, int]], token: str,
                       routes: Routes | None = None, client_memory_bytes: int | None = None,
                       objective: str = "latency", client_first: bool = True,
                       solver: str = "auto", threads: int = 2, probe_cfg: ProbeConfig | None = None,
                       progress: Progress | None = None) -> tuple[Problem, Plan, dict[str, Any]]:
    """Probe every device and link, then solve: (problem, plan, the probe result). `threads`:
    the onnxruntime threads this client will run its layers with."""
    probed = await probe(addrs, token, manifest, probe_cfg, routes=routes,
                         client_memory_bytes=client_memory_bytes, client_threads=threads,
                         progress=progress)
    p = problem_from(manifest, cluster_spec(probed), objective, client_first=client_first)
    return p, solve(p, solver), probed


async def plan_live(args: argparse.Namespace, manifest: mf.Manifest, addrs: list[tuple[str, int]],
                    progress: Progress | None = None) -> tuple[Problem, Plan, dict[str, Any]]:
    """plan_cluster() with the CLI's flags."""
    return await plan_cluster(manifest, addrs, cluster_token(args),
                              parse_routes(getattr(args, "route", None)), client_memory(args),
                              getattr(args, "objective", "latency"),
                              not getattr(args, "no_client_first", False),
                              getattr(args, "solver", "auto"), args.threads, progress=progress)


async def connect_backend(args: argparse.Namespace,
                          manifest: mf.Manifest) -> tuple[ClusterBackend, dict[str, Any] | None]:
    """Deploy --split when given, else the planner's plan; (backend, the plan's JSON or None)."""
    from rich.console import Console

    from edgelite.cli.plan import plan_json
    from edgelite.cli.views import step_bar, transfer_bars

    token, addrs = cluster_token(args), parse_nodes(args.nodes)
    console = Console(stderr=True)
    live = console.is_terminal and not getattr(args, "json", False)  # bars only for people
    if args.split:
        assignment, shown = in_order(parse_split(args.split, manifest.num_layers, len(addrs))), None
    else:
        with step_bar(console, "probe") if live else nullcontext() as progress:
            p, plan, _ = await plan_live(args, manifest, addrs, progress)
        assignment, shown = assignment_of(p, plan, addrs), plan_json(p, plan)
        log.info("plan: %s", [(s["device"], s["first_layer"], s["last_layer"]) for s in shown["stages"]])
    with transfer_bars(console, "deploy") if live else nullcontext() as progress:
        backend = await open_cluster(manifest, addrs, assignment, token, threads=args.threads,
                                     routes=parse_routes(getattr(args, "route", None)),
                                     progress=progress)
    return backend, shown
