"""`edgelite probe`: measure every device and every link between them."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import edgelite
from edgelite.cli import jsonout, options, runner, views
from edgelite.net.routes import parse_routes


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    pr = sub.add_parser("probe", parents=parents, formatter_class=options.HelpFormatter,
                        help="measure devices and every link between them")
    options.nodes_flags(pr, default="this device alone")
    pr.add_argument("--model", help="model folder: FLOP/s on its own layer shapes")
    pr.add_argument("--token", help="cluster token (default: $EDGELITE_TOKEN)")
    pr.add_argument("--repeat", type=int, default=1, help="rounds, smoothed with a bias-corrected EMA")
    options.route_flag(pr)
    pr.add_argument("--client-memory-mb", type=float, help="memory budget to report for this device")
    pr.add_argument("--json", action="store_true", help="print the result as one JSON object")
    pr.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    manifest = edgelite.load_manifest(args.model) if args.model else None
    token = options.token(args, required=bool(args.nodes))
    if not args.nodes:
        print("no --nodes: this device alone (--nodes auto finds the nodes on the LAN, or give "
              "HOST:PORT,...)", file=sys.stderr)
    result = runner.run(_probe(args, token or "", manifest))  # ("": no node to ask)
    if args.json:
        print(jsonout.dumps(result))
        return 0

    views.console().print(views.probe_view(result))
    return 0


async def _probe(args: argparse.Namespace, token: str, manifest: Any) -> dict[str, Any]:
    return await edgelite.probe(await options.found_nodes(args), token, manifest,
                                repeat=args.repeat, routes=parse_routes(args.route),
                                client_memory_bytes=options.client_memory(args))
