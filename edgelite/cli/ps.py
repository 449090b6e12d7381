"""`edgelite ps`: what runs where: each node's memory, the plans and sessions on it."""

from __future__ import annotations

import argparse
import json
from typing import Any

import edgelite
from edgelite.cli import options, runner

MIB = 1 << 20


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ps", parents=parents, formatter_class=options.HelpFormatter,
                       help="what runs where: each node's memory, plans and sessions",
                       description="Asks each node (as this device's client: your plans in "
                                   "full, other clients' as counts) for its memory, the layers it "
                                   "holds for which plan, its sessions and KV.")
    options.nodes_flags(p, default="auto: the nodes with this token on the LAN")
    p.add_argument("--token", help="cluster token (default: $EDGELITE_TOKEN)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)


# what a stage's batched_decode says (an older node's stats have none)
BATCHED = {True: "; sessions' decode steps batched",
           False: "; decode steps one session at a time (onnxruntime's operators would batch them "
                  "otherwise than alone)"}


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / MIB:,.0f}"


def line(s: dict[str, Any]) -> list[str]:
    """One node's lines (a node whose stats are not what this edgelite reads: one line saying so)."""
    try:
        return _lines(s)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        return [f"{s.get('addr', '?')}: its stats are not what this edgelite reads ({type(exc).__name__}: "
                f"{str(exc)[:80]})"]


def _lines(s: dict[str, Any]) -> list[str]:
    if not s["reachable"]:
        why = s["error"].removeprefix(f"node {s['addr']}: ")
        return [f"{s['addr']}: does not answer ({why})"]
    mem = s.get("memory") or {}
    budget = mem.get("budget_bytes")
    head = (f"{s['addr']} ({s.get('node', '?')}; kernels {s.get('kernel', '?')}): "
            f"{_mib(mem.get('rss_bytes'))} MiB held"
            + (f" of {_mib(budget)}" if budget else " (no budget)")
            + f", peak {_mib(mem.get('peak_rss_bytes'))}; KV {_mib(s.get('kv_bytes'))} of "
            f"{_mib(s.get('kv_node_budget_bytes'))} MiB; {s.get('own_sessions', 0)} of your sessions, "
            f"{s.get('sessions', 0)} in all")
    out = [head]
    for st in s.get("stages", []):
        out.append(f"  {st['model']}: layers {st['layers'][0]}-{st['layers'][1]} (plan {st['plan_id'][:12]})"
                   + BATCHED.get(st.get("batched_decode"), ""))
    if s.get("batches"):
        out.append(f"  {s['batched_steps']:,} decode steps run in {s['batches']:,} batches")
    if not s.get("stages"):
        out.append("  no plan of yours loaded")
    if s.get("other_plans"):
        out.append(f"  and {s['other_plans']} plan(s) of other clients")
    return out


def run(args: argparse.Namespace) -> int:
    token = options.token(args, required=True)
    assert token is not None
    if not args.nodes:
        args.nodes = "auto"
    states = runner.run(_status(args, token))
    if args.json:
        print(json.dumps({"nodes": states}))
        return 0
    if not states:
        print("no nodes answered on the LAN (give --nodes HOST:PORT,...)")
    for s in states:
        print("\n".join(line(s)))
    return 0


async def _status(args: argparse.Namespace, token: str) -> list[dict[str, Any]]:
    return await edgelite.status(await options.found_nodes(args), token, options.client_config(args))
