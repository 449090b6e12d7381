"""Plan a model over phones described in a file (no phones needed) and print the plan.

    python examples/plan_what_if.py --model models/smollm2-135m --cluster examples/phones.json

Reads only the model's manifest.json. Change a phone's memory or a link's loss in the JSON and
see how the placement moves.
"""

import argparse
import json
from pathlib import Path

import edgelite


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=Path("models/smollm2-135m"))
    ap.add_argument("--cluster", type=Path, default=Path(__file__).with_name("phones.json"))
    ap.add_argument("--objective", choices=["latency", "throughput"], default="latency")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cluster = json.loads(args.cluster.read_text())
    try:
        plan = edgelite.plan(edgelite.load_manifest(args.model), cluster, args.objective)
    except edgelite.PlanInfeasible as exc:
        raise SystemExit(f"no plan: {exc}") from exc
    if args.json:
        print(json.dumps(plan.to_json()))
        return
    for s in plan.stages:
        print(f"{s.device:>10}  layers {s.first:>2}-{s.last:<2}  compute {s.compute_ms:6.2f} ms"
              f"  link in {s.hop_in_ms:6.2f} ms")
    print(f"{plan.solver} ({plan.status}): {plan.predicted.expected:.1f} ms/token expected")
    if plan.with_nodes_ms is not None:  # every layer stayed on the client: say why
        print(f"every layer on {plan.stages[0].device}: with the other phones the best plan "
              f"would take {plan.with_nodes_ms:.1f} ms/token")


if __name__ == "__main__":
    main()
