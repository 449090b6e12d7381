"""Plan a model over phones described in a file (no phones needed) and print the plan.

    python examples/plan_what_if.py --model models/smollm2-135m --cluster examples/phones.json

Reads only the model's manifest.json. Change a phone's memory or a link's loss in the JSON and
see how the placement moves.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from edgelite import manifest as mf
from edgelite.cli.plan import plan_json
from edgelite.cli.views import plan_view
from edgelite.errors import PlanInfeasible
from edgelite.plan.model import solve
from edgelite.plan.spec import problem_from


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=Path("models/smollm2-135m"))
    ap.add_argument("--cluster", type=Path, default=Path(__file__).with_name("phones.json"))
    ap.add_argument("--objective", choices=["latency", "throughput"], default="latency")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = mf.load(args.model)
    spec = json.loads(args.cluster.read_text())
    problem = problem_from(m, spec, args.objective)
    try:
        out = plan_json(problem, solve(problem))
    except PlanInfeasible as exc:
        raise SystemExit(f"no plan: {exc}") from exc
    if args.json:
        print(json.dumps(out))
    else:
        Console().print(plan_view(out))


if __name__ == "__main__":
    main()
