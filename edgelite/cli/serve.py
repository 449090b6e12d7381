"""`edgelite serve`: a gateway feeding many users' requests through one model or cluster."""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path
from typing import Any

import edgelite
from edgelite.cli import options, runner, views
from edgelite.client.backend import ClusterBackend
from edgelite.client.llm import LLM
from edgelite.config import GatewayConfig, RuntimeConfig, SchedulerConfig
from edgelite.serve.gateway import Gateway, load_users
from edgelite.serve.scheduler import Scheduler

log = logging.getLogger(__name__)
LOCAL_KV_TOKENS = 8192  # the scheduler's KV budget when every layer runs here


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    s, g = SchedulerConfig, GatewayConfig
    sv = sub.add_parser("serve", parents=parents, formatter_class=options.HelpFormatter,
                        help="serve many users through the cluster (priority scheduler)")
    options.model_flags(sv)
    options.generation_flags(sv)  # the defaults of requests that do not say
    options.cluster_flags(sv)
    sv.add_argument("--host", default=g.host, help="address to listen on")
    sv.add_argument("--port", type=int, default=g.port, help="0 = any free port (printed)")
    sv.add_argument("--users", type=Path, required=True,
                    help='users.json: {"users": [{"name", "token", "tier"}]}')
    sv.add_argument("--kv-tokens", type=int, help="KV memory for the scheduler, in tokens "
                                                  "(default: what the nodes' budgets hold)")
    sv.add_argument("--max-requests", type=int, default=s.max_requests,
                    help="requests decoding at once")
    sv.add_argument("--patience-s", type=float, default=s.patience_s,
                    help="past this wait a request outranks every new arrival")
    sv.add_argument("--max-preemptions", type=int, default=s.max_preemptions,
                    help="how often one request may be preempted")
    sv.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="any other limit or timeout of the gateway (GatewayConfig in "
                         "edgelite/config.py), e.g. --set max_requests_per_user=4")
    sv.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return runner.run(serve(args))


async def kv_of(llm: LLM, runtime: RuntimeConfig) -> tuple[int | None, tuple[int, ...]]:
    """How many positions of KV the cluster holds (the tightest stage's budget / its bytes per
    position; None when every layer runs here), and the capacity buckets it counts them in."""
    backend = llm.backend
    if not isinstance(backend, ClusterBackend):
        return None, runtime.kv_buckets
    stats = await backend.cluster.stats()
    tokens, buckets = math.inf, runtime.kv_buckets
    for st in backend.plan.remote:
        node = stats[st.addr]  # type: ignore[index]
        per_token = llm.manifest.kv_bytes_per_token(st.first, st.last)
        tokens = min(tokens, node["kv_budget_bytes"] // max(1, per_token))
        buckets = tuple(node.get("kv_buckets", buckets))
    return (None if tokens == math.inf else int(tokens)), buckets


async def serve(args: argparse.Namespace) -> int:
    users = load_users(args.users)
    gateway_cfg = GatewayConfig(**{"host": args.host, "port": args.port,
                                   **options.config_overrides(args.set, GatewayConfig)})
    console = views.stderr_console()
    with views.connect_bars(console, live=console.is_terminal) as progress:
        llm = await edgelite.connect(args.model, **options.connect_kwargs(args), progress=progress)
    async with llm:
        nodes_kv, buckets = await kv_of(llm, options.runtime_config(args))
        cluster_kv = nodes_kv or args.kv_tokens or LOCAL_KV_TOKENS
        kv = min(cluster_kv, args.kv_tokens or cluster_kv)
        sched = Scheduler(SchedulerConfig(context_limit=min(llm.manifest.max_positions, max(buckets)),
                                          kv_tokens=kv, max_requests=args.max_requests,
                                          patience_s=args.patience_s, kv_buckets=buckets,
                                          max_preemptions=args.max_preemptions))
        log.info("scheduler: %d KV tokens (cluster %d), %d requests at once", kv, cluster_kv,
                 args.max_requests)
        gw = Gateway(llm.backend, llm.tokenizer, users, sched,
                     gateway_cfg, llm.generation)
        await gw.start()
        print(f"edgelite gateway listening on {gw.cfg.host}:{gw.port}", flush=True)
        await gw.run()
    return 0
