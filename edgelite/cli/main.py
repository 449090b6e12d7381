"""edgelite command line: one subcommand per step of the user's work."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from edgelite.errors import EdgeliteError

Command = Callable[[argparse.Namespace], int]


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=Path, help="folder written by edgelite-export")
    p.add_argument("--threads", type=int, default=2, help="onnxruntime threads per session")


def _gen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nodes", help="host:port,... of stage nodes (default: run locally)")
    p.add_argument("--split", help="layer ranges per node, e.g. 0-9,10-19,20-29 "
                                   "(default: probe and plan)")
    p.add_argument("--token", help="cluster token (default: $EDGELITE_TOKEN)")
    _planning_args(p)


def _planning_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--route", action="append", metavar="SRC>DST=HOST:PORT[/UDP]",
                   help="how node SRC reaches node DST when not at DST's --nodes address "
                        "(e.g. through a link emulator); repeatable")
    p.add_argument("--client-memory-mb", type=float,
                   help="memory the plan may use on this device (default: its free memory)")
    p.add_argument("--objective", choices=["latency", "throughput"], default="latency")
    p.add_argument("--solver", choices=["auto", "milp", "milp-literal", "milp-aggregated", "dp"],
                   default="auto")
    p.add_argument("--no-client-first", action="store_true",
                   help="the client need not hold layer 0")


def cmd_generate(args: argparse.Namespace) -> int:
    from edgelite.cli.generate import run_generate
    from edgelite.cli.node import install_uvloop

    install_uvloop()
    result = asyncio.run(run_generate(args, stream=None if args.json else sys.stdout))
    if args.json:
        print(json.dumps(result))
    else:
        print()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    if args.gateway:
        from edgelite.cli.serve import run_gateway_chat

        return asyncio.run(run_gateway_chat(args))
    if args.model is None:
        raise EdgeliteError("chat needs --model DIR (or --gateway HOST:PORT)")
    from edgelite.cli.generate import run_chat

    return asyncio.run(run_chat(args))


def cmd_serve(args: argparse.Namespace) -> int:
    from edgelite.cli.node import install_uvloop
    from edgelite.cli.serve import run_serve

    def ready(gw) -> None:
        print(f"edgelite gateway listening on {gw.cfg.host}:{gw.port}", flush=True)

    install_uvloop()
    return asyncio.run(run_serve(args, ready))


def cmd_demo(args: argparse.Namespace) -> int:
    from edgelite.cli.demo import run_demo
    from edgelite.cli.node import install_uvloop

    install_uvloop()
    return asyncio.run(run_demo(args))


def cmd_node(args: argparse.Namespace) -> int:
    from edgelite.cli.node import run_node

    def ready(node, generated: bool) -> None:
        if generated:
            print(f"cluster token (pass it to the client as --token or EDGELITE_TOKEN): {node.token}")
        print(f"edgelite node {node.name} listening on {node.cfg.host}:{node.port}", flush=True)

    return run_node(args, ready)


def cmd_plan(args: argparse.Namespace) -> int:
    from edgelite.cli.plan import run_plan

    return run_plan(args)


def cmd_probe(args: argparse.Namespace) -> int:
    from edgelite.probe.cluster import run_probe

    result = run_probe(args)
    if args.json:
        print(json.dumps(result))
        return 0
    from rich.console import Console

    from edgelite.cli.views import probe_view

    Console().print(probe_view(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgelite", description="Run one LLM across several phones.")
    p.add_argument("-v", "--verbose", action="count", default=0)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a reply to one prompt")
    _model_args(g)
    _gen_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object with the result")
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("prompt")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat")
    c.add_argument("--model", type=Path, help="folder written by edgelite-export")
    c.add_argument("--threads", type=int, default=2, help="onnxruntime threads per session")
    _gen_args(c)
    c.add_argument("--gateway", help="host:port of an `edgelite serve` gateway (no model needed)")
    c.add_argument("--user", help="your user name on the gateway")
    c.add_argument("--user-token", help="your token on the gateway (default: $EDGELITE_USER_TOKEN)")
    c.add_argument("--plain", action="store_true", help="bare text, no live footer (default "
                                                        "when stdout is not a terminal)")
    c.set_defaults(func=cmd_chat)

    d = sub.add_parser("demo", help="three emulated phones on this machine: probe, plan, deploy, chat")
    d.add_argument("--model", type=Path, default=Path("models/smollm2-135m"),
                   help="SmolLM2-135M export (made here on the first run)")
    d.add_argument("--prompt", help="answer this, print the plan and stats, and exit")
    d.add_argument("--threads", type=int, default=1, help="onnxruntime threads per node")
    d.add_argument("--max-tokens", type=int, default=96)
    d.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    d.add_argument("--top-p", type=float, default=1.0)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--plain", action="store_true", help="bare text (default without a terminal)")
    d.add_argument("--json", action="store_true", help="with --prompt: one JSON object")
    d.add_argument("--svg", type=Path, help="with --prompt: save the screen as an SVG picture")
    d.add_argument("--deploy-over-links", action="store_true",
                   help="push the layer files through the emulated Wi-Fi instead of seeding the "
                        "nodes' file caches")
    d.set_defaults(func=cmd_demo)

    sv = sub.add_parser("serve", help="serve many users through the cluster (priority scheduler)")
    _model_args(sv)
    _gen_args(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=7080, help="0 = any free port (printed)")
    sv.add_argument("--users", type=Path, required=True,
                    help='users.json: {"users": [{"name", "token", "tier"}]}')
    sv.add_argument("--kv-tokens", type=int, help="KV memory for the scheduler, in tokens "
                                                  "(default: what the nodes' budgets hold)")
    sv.add_argument("--max-requests", type=int, default=8, help="requests decoding at once")
    sv.add_argument("--patience-s", type=float, default=2.0,
                    help="past this wait a request outranks every new arrival")
    sv.add_argument("--max-preemptions", type=int, default=2)
    sv.set_defaults(func=cmd_serve)

    pl = sub.add_parser("plan", help="place layers on devices (HiGHS MILP)")
    pl.add_argument("--model", required=True, type=Path, help="model folder (reads manifest.json only)")
    pl.add_argument("--cluster", type=Path, help="cluster.json: devices and links (offline what-if)")
    pl.add_argument("--nodes", help="host:port,... to probe live")
    pl.add_argument("--token", help="cluster token (default: $EDGELITE_TOKEN)")
    _planning_args(pl)
    pl.add_argument("--kv-tokens", type=int, default=2048, help="context to reserve KV memory for")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)

    pr = sub.add_parser("probe", help="measure devices and every link between them")
    pr.add_argument("--nodes", required=True, help="host:port,...")
    pr.add_argument("--model", type=Path, help="model folder: FLOP/s on its own layer shapes")
    pr.add_argument("--token", help="cluster token (default: $EDGELITE_TOKEN)")
    pr.add_argument("--repeat", type=int, default=1, help="rounds, smoothed with a bias-corrected EMA")
    pr.add_argument("--route", action="append", metavar="SRC>DST=HOST:PORT[/UDP]",
                    help="how node SRC reaches node DST (see generate --help); repeatable")
    pr.add_argument("--client-memory-mb", type=float, help="memory budget to report for this device")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=cmd_probe)

    n = sub.add_parser("node", help="run a stage node")
    n.add_argument("--host", default="0.0.0.0")
    n.add_argument("--port", type=int, default=7070, help="0 = any free port (printed)")
    n.add_argument("--data-dir", type=Path, default=Path("~/.edgelite").expanduser())
    n.add_argument("--threads", type=int, default=2)
    n.add_argument("--token", help="cluster token (default: $EDGELITE_TOKEN, else generated)")
    n.add_argument("--kv-budget-mb", type=float, default=512, help="KV memory of all sessions")
    n.add_argument("--max-batch", type=int, default=8,
                   help="decode steps of different sessions arriving together run as one batch "
                        "of up to this many (1: never batch)")
    n.add_argument("--memory-mb", type=float,
                   help="memory plans may use on this device (default: its free memory)")
    n.add_argument("--name", help="device name shown to the client")
    n.add_argument("--plain", action="store_true", help="log lines only, no live panel (default "
                                                        "when stdout is not a terminal)")
    n.set_defaults(func=cmd_node)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except EdgeliteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
