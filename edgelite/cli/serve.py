"""`edgelite serve` and `edgelite chat --gateway`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
from collections.abc import Callable

from edgelite import manifest as mf
from edgelite.client.cluster import ClusterBackend
from edgelite.config import GatewayConfig
from edgelite.engine.tokenizer import Tokenizer
from edgelite.errors import EdgeliteError
from edgelite.serve.gateway import Gateway, load_users
from edgelite.serve.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger(__name__)


async def kv_tokens_of(backend: ClusterBackend) -> int:
    """How many tokens of KV the cluster holds: the tightest stage's budget / its bytes per token."""
    cluster, m = backend.cluster, backend.manifest
    budgets = {link.name: st["kv_budget_bytes"]
               for link, st in zip(cluster.links, await cluster.stats(), strict=True)}
    tokens = math.inf
    for link, a, b in cluster.stages:
        per_token = sum(e.kv_bytes_per_token for e in m.layers[a:b + 1])
        tokens = min(tokens, budgets[link.name] // max(1, per_token))
    return int(tokens) if tokens != math.inf else 1 << 30


async def run_serve(args: argparse.Namespace, ready: Callable[[Gateway], None]) -> int:
    from edgelite.cli.generate import open_backend

    users = load_users(args.users)
    manifest = mf.load(args.model)
    backend, _plan = await open_backend(args, manifest)
    try:
        cluster_kv = (await kv_tokens_of(backend) if isinstance(backend, ClusterBackend)
                      else args.kv_tokens or 8192)
        kv = min(cluster_kv, args.kv_tokens or cluster_kv)
        sched = Scheduler(SchedulerConfig(context_limit=manifest.max_positions,
                                          kv_tokens=kv, max_requests=args.max_requests,
                                          patience_s=args.patience_s,
                                          max_preemptions=args.max_preemptions))
        log.info("scheduler: %d KV tokens (cluster %d), %d requests at once", kv, cluster_kv,
                 args.max_requests)
        gw = Gateway(backend, Tokenizer(manifest), users, sched,
                     GatewayConfig(host=args.host, port=args.port))
        await gw.start()
        ready(gw)
        await gw.run()
    finally:
        await backend.close()
    return 0


async def run_gateway_chat(args: argparse.Namespace) -> int:
    from edgelite.client.cluster import parse_nodes
    from edgelite.serve.client import GatewayClient

    token = args.user_token or os.environ.get("EDGELITE_USER_TOKEN")
    if not token or not args.user:
        raise EdgeliteError("chat --gateway needs --user and --user-token (or EDGELITE_USER_TOKEN)")
    (host, port), = parse_nodes(args.gateway)
    client = await GatewayClient.connect(host, port, args.user, token)
    history: list[dict[str, str]] = []
    try:
        while True:
            try:
                line = await asyncio.to_thread(input, "> ")
            except EOFError:
                return 0
            cmd = line.strip()
            if cmd in ("/quit", "/exit"):
                return 0
            if cmd == "/reset":
                history.clear()
                continue
            if cmd == "/stats":
                print(json.dumps(await client.stats()))
                continue
            history.append({"role": "user", "content": line})
            parts = []
            async for piece in client.generate(history, args.max_tokens, args.temperature):
                parts.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
            history.append({"role": "assistant", "content": "".join(parts)})
            f = client.last
            sys.stdout.write(f"\n[{f.get('ttft_ms') or 0:.0f} ms to first token, "
                             f"{f.get('decode_tok_s', 0):.1f} tok/s, tier {f.get('tier')}]\n")
    finally:
        await client.close()
