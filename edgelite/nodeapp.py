"""`edgelite node`: configure and run one stage node until Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import Callable

from edgelite.config import NodeConfig
from edgelite.node import Node

log = logging.getLogger(__name__)


def resolve_token(explicit: str | None) -> tuple[str, bool]:
    """(token, generated?) from --token, $EDGELITE_TOKEN, or a fresh random one."""
    token = explicit or os.environ.get("EDGELITE_TOKEN")
    return (token, False) if token else (secrets.token_urlsafe(16), True)


def install_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


async def serve(node: Node, ready: Callable[[Node], None]) -> None:
    await node.start()
    ready(node)
    await node.run()


def run_node(args: argparse.Namespace, ready: Callable[[Node, bool], None]) -> int:
    token, generated = resolve_token(args.token)
    cfg = NodeConfig(host=args.host, port=args.port, threads=args.threads,
                     kv_budget_bytes=args.kv_budget_mb * 1024 * 1024,
                     memory_budget_bytes=None if args.memory_mb is None else int(args.memory_mb * 2**20))
    args.data_dir.mkdir(parents=True, exist_ok=True)
    node = Node(cfg, token, args.data_dir, **({"name": args.name} if args.name else {}))
    fast = install_uvloop()
    log.info("event loop: %s", "uvloop" if fast else "asyncio")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(node, lambda n: ready(n, generated)))
    return 0

