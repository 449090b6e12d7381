"""`edgelite plan`: place a model's layers on a cluster (a cluster.json or a live probe)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import edgelite
from edgelite.cli import jsonout, options, runner, views
from edgelite.config import RuntimeConfig
from edgelite.errors import EdgeliteError
from edgelite.prober.cluster import cluster_spec


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    pl = sub.add_parser("plan", parents=parents, formatter_class=options.HelpFormatter,
                        help="place layers on devices (HiGHS MILP, or the exact DP)")
    pl.add_argument("--model", required=True, help="model folder (reads manifest.json only)")
    pl.add_argument("--cluster", help="cluster.json: devices and links (offline what-if)")
    options.nodes_flags(pl, default="none: give --cluster")
    pl.add_argument("--token", help="cluster token (default: $EDGELITE_TOKEN)")
    options.planning_flags(pl)
    pl.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    pl.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    m = edgelite.load_manifest(args.model)
    if args.cluster:
        try:
            with open(args.cluster) as f:
                spec = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise EdgeliteError(f"{args.cluster}: {exc}") from exc
    elif args.nodes:
        from edgelite.net.routes import parse_routes

        token = options.token(args, required=True)
        assert token is not None

        async def measure() -> dict[str, Any]:
            return await edgelite.probe(await options.found_nodes(args), token, m,
                                        routes=parse_routes(args.route),
                                        client_memory_bytes=options.client_memory(args))

        probed = runner.run(measure())
        spec = cluster_spec(probed)
    else:
        raise EdgeliteError("give --cluster cluster.json or --nodes HOST:PORT,...")
    plan = edgelite.plan(m, spec, args.objective, args.solver, not args.no_client_first,
                         args.context, chunks=RuntimeConfig().plan_chunks)
    if args.json:
        print(jsonout.dumps(plan.to_json()))
    else:

        views.console().print(views.plan_view(plan.to_json()))
    return 0
