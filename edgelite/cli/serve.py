"""`edgelite serve`: a gateway feeding many users' requests through one model or cluster."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import edgelite
from edgelite.cli import options, runner, views
from edgelite.client.llm import LLM
from edgelite.config import GatewayConfig, HttpConfig, RuntimeConfig, SchedulerConfig
from edgelite.errors import EdgeliteError, MissingDependency
from edgelite.planner.model import Plan
from edgelite.serve.gateway import Gateway
from edgelite.serve.native import NativeDoor
from edgelite.serve.page import cluster_view
from edgelite.serve.scheduler import Scheduler
from edgelite.serve.users import load_users

if TYPE_CHECKING:
    from edgelite.serve.http import HttpApi

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
    sv.add_argument("--port", type=options.port_number, default=g.port, help="0 = any free port (printed)")
    sv.add_argument("--users", type=Path,
                    help='users.json: {"users": [{"name", "token", "tier"}]} (needed by the '
                         'native port; without it HTTP requests need no token)')
    sv.add_argument("--http", metavar="[HOST:]PORT", type=http_address,
                    help="also serve the OpenAI-compatible API here (host default 127.0.0.1; "
                         "needs the http extra: pip install 'edgelite[http]')")
    sv.add_argument("--http-set", action="append", default=[], metavar="NAME=VALUE",
                    help="a limit or timeout of the HTTP API (HttpConfig in edgelite/config.py), "
                         "e.g. --http-set sse_keepalive_s=2")
    sv.add_argument("--no-native", action="store_true",
                    help="serve only the HTTP API (no native gateway port)")
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
    backend = llm.cluster
    if backend is None:
        return None, runtime.kv_buckets
    stats = await backend.cluster.stats()
    tokens, buckets = math.inf, runtime.kv_buckets
    for st in backend.plan.remote:
        node = stats[st.addr]  # type: ignore[index]
        dtype = llm.manifest.kv_dtype(str(node.get("kv_dtype", "float32")), bool(node.get("invariant", True)))
        per_token = llm.manifest.kv_bytes(st.first, st.last, 1, dtype)
        tokens = min(tokens, node["kv_budget_bytes"] // max(1, per_token))
        buckets = tuple(node.get("kv_buckets", buckets))
    return (None if tokens == math.inf else int(tokens)), buckets


def http_address(spec: str) -> tuple[str, int]:
    """argparse type of --http: "[HOST:]PORT" -> (host, port)."""
    host, _, port = spec.rpartition(":")
    return host or HttpConfig.host, options.port_number(port)


async def serve(args: argparse.Namespace) -> int:
    if args.users is None and not args.no_native:
        raise EdgeliteError("the native gateway port needs --users; for the HTTP API alone "
                            "add --http [HOST:]PORT --no-native")
    if args.no_native and not args.http:
        raise EdgeliteError("--no-native leaves nothing to serve without --http")
    if args.speculate not in ("off", "lookup"):
        raise EdgeliteError("serve speculates by prompt lookup only: --speculate lookup or off "
                            "(a draft model runs on a client: generate or chat --speculate DIR)")
    options.generation_config(args)  # the requests' defaults, checked before anything listens
    users = load_users(args.users) if args.users is not None else None
    gateway_cfg = GatewayConfig(**{"host": args.host, "port": args.port,
                                   **options.config_overrides(args.set, GatewayConfig)})
    async with contextlib.AsyncExitStack() as stack:
        api = None
        if args.http:
            api = await stack.enter_async_context(_http(args, users))
        console = views.stderr_console()
        with views.connect_bars(console, live=console.is_terminal) as progress:
            llm = await edgelite.connect(args.model, **options.connect_kwargs(args), progress=progress)
        await stack.enter_async_context(llm)
        nodes_kv, buckets = await kv_of(llm, options.runtime_config(args))
        cluster_kv = nodes_kv or args.kv_tokens or LOCAL_KV_TOKENS
        kv = min(cluster_kv, args.kv_tokens or cluster_kv)
        sched = Scheduler(SchedulerConfig(context_limit=min(llm.manifest.max_positions, max(buckets)),
                                          kv_tokens=kv, max_requests=args.max_requests,
                                          patience_s=args.patience_s, kv_buckets=buckets,
                                          max_preemptions=args.max_preemptions))
        log.info("scheduler: %d KV tokens (cluster %d), %d requests at once", kv, cluster_kv,
                 args.max_requests)
        gw = Gateway(llm.backend, llm.tokenizer, users or {}, sched, gateway_cfg, llm.generation)
        print(f"plan: {plan_line(llm.plan)}", flush=True)  # (for a gateway run in the background)
        if not args.no_native:
            door = NativeDoor(gw, users or {}, gateway_cfg)
            await door.start()
            stack.callback(door.close)
            print(f"edgelite gateway listening on {gateway_cfg.host}:{door.port}", flush=True)
        if api is not None:
            api.gateway = gw  # /health turns 200
            api.cluster = functools.partial(cluster_view, llm, gw, api.cfg.cluster_stats_timeout_s)
        await gw.run()
    return 0


def plan_line(plan: Plan) -> str:
    """The plan in one line: which layers run where."""
    return ", ".join(f"layers {s.first}-{s.last} on {s.device}"
                     + (f" ({s.addr})" if s.addr is not None and str(s.addr) != s.device else "")
                     for s in plan.stages)


@contextlib.asynccontextmanager
async def _http(args: argparse.Namespace, users: dict | None) -> AsyncIterator[HttpApi]:
    """The HTTP API, listening from before the plan is made (/health: 503 until deployed)."""
    try:
        from edgelite.serve.http import HttpApi, served
    except ImportError as exc:
        raise MissingDependency(f"--http needs the http extra ({exc.name} is missing): "
                                "pip install 'edgelite[http]'") from exc
    host, port = args.http
    if users is None and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("the HTTP API on %s has no --users: anyone who reaches it may use the "
                    "cluster", host)
    model_id = Path(args.model).name
    api = HttpApi(model_id, users, HttpConfig(**{
        "host": host, "port": port, **options.config_overrides(args.http_set, HttpConfig)}))
    async with served(api) as bound:
        print(f"edgelite HTTP API (OpenAI-compatible) listening on http://{host}:{bound}/v1 "
              f"(model {model_id!r}); the cluster page and a chat: http://{host}:{bound}/", flush=True)
        yield api
