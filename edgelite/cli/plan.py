"""`edgelite plan`: read the manifest and a cluster (file or live probe), solve, show the plan."""

from __future__ import annotations

import argparse
import json
from typing import Any

from edgelite import manifest as mf
from edgelite.errors import EdgeliteError
from edgelite.plan.model import Plan, Problem, predict, solve
from edgelite.plan.spec import problem_from


def plan_json(p: Problem, plan: Plan) -> dict[str, Any]:
    pr = predict(p, plan.stages)
    return {"objective": plan.objective, "solver": plan.solver, "status": plan.status,
            "solve_ms": round(plan.solve_ms, 2), "value_ms": round(plan.value, 4),
            "stages": [{"device": p.devices[d].name, "first_layer": a, "last_layer": b,
                        "compute_ms": round(r["compute_ms"], 4), "hop_in_ms": round(r["hop_in_ms"], 4)}
                       for (d, a, b), r in zip(plan.stages, pr.per_stage, strict=True)],
            "predicted_ms": {"total": round(pr.total, 4), "compute": round(pr.compute, 4),
                             "data": round(pr.data, 4), "qos": round(pr.qos, 4),
                             "complexity": round(pr.complexity, 4),
                             "bottleneck": round(pr.bottleneck, 4)},
            "expected_ms_per_token": round(pr.expected, 4)}


def show(out: dict[str, Any], stderr: bool = False) -> None:
    from rich.console import Console

    from edgelite.cli.views import plan_view

    Console(stderr=stderr).print(plan_view(out))


def run_plan(args: argparse.Namespace) -> int:
    m = mf.load(args.model)
    if args.cluster:
        try:
            spec = json.loads(args.cluster.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise EdgeliteError(f"{args.cluster}: {exc}") from exc
    elif args.nodes:
        import asyncio

        from edgelite.probe.cluster import probe_cluster_spec

        spec = asyncio.run(probe_cluster_spec(args, m))
    else:
        raise EdgeliteError("give --cluster cluster.json or --nodes host:port,...")
    p = problem_from(m, spec, args.objective, client_first=not args.no_client_first,
                     kv_tokens=args.kv_tokens)
    out = plan_json(p, solve(p, args.solver))
    if args.json:
        print(json.dumps(out))
    else:
        show(out)
    return 0
