"""`edgelite node`: configure and run one stage node until Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable

from edgelite.config import NodeConfig
from edgelite.node.server import Node

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


async def serve(node: Node, ready: Callable[[Node], None], panel: bool = False) -> None:
    await node.start()
    ready(node)
    if not panel:
        await node.run()
        return
    async with asyncio.TaskGroup() as tg:
        tg.create_task(node.run())
        tg.create_task(show_panel(node))


async def show_panel(node: Node, every_s: float = 1.0) -> None:
    """A live panel of the node's state, redrawn every `every_s` (reads state only)."""
    from rich.live import Live

    from edgelite.cli.views import node_panel

    addr = f"{node.cfg.host}:{node.port}"
    runs, t = node.store.runs, time.monotonic()

    def view() -> object:
        stats = {**node.store.stats(), "bad_frames": node.bad_frames, "runs_per_s": rate}
        return node_panel(node.name, addr, stats, sorted(c.peer for c in node.conns))

    rate = 0.0
    with Live(view(), refresh_per_second=2) as live:
        while True:
            await asyncio.sleep(every_s)
            now = time.monotonic()
            rate, runs, t = (node.store.runs - runs) / (now - t), node.store.runs, now
            live.update(view())


def run_node(args: argparse.Namespace, ready: Callable[[Node, bool], None]) -> int:
    token, generated = resolve_token(args.token)
    cfg = NodeConfig(host=args.host, port=args.port, threads=args.threads,
                     kv_budget_bytes=int(args.kv_budget_mb * 2**20),
                     batch_max_steps=max(1, args.max_batch),
                     memory_budget_bytes=None if args.memory_mb is None else int(args.memory_mb * 2**20))
    args.data_dir.mkdir(parents=True, exist_ok=True)
    node = Node(cfg, token, args.data_dir, **({"name": args.name} if args.name else {}))
    panel = not args.plain and sys.stdout.isatty()
    fast = install_uvloop()
    log.info("event loop: %s", "uvloop" if fast else "asyncio")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(node, lambda n: ready(n, generated), panel))
    return 0

