"""`edgelite node`: run one stage node until Ctrl-C."""

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
from pathlib import Path
from typing import Any

from edgelite import paths
from edgelite.cli import options, runner
from edgelite.config import NodeConfig, RuntimeConfig
from edgelite.engine.profile import resident_bytes
from edgelite.engine.session import PROVIDERS, providers
from edgelite.errors import EdgeliteError
from edgelite.net.discovery import ANY_HOST, lan_address
from edgelite.node.server import Node

log = logging.getLogger(__name__)


def resolve_token(explicit: str | None) -> tuple[str, bool]:
    """(token, generated?) from --token, $EDGELITE_TOKEN, or a fresh random one."""
    token = explicit or os.environ.get("EDGELITE_TOKEN")
    return (token, False) if token else (secrets.token_urlsafe(16), True)


async def serve(node: Node, ready: Callable[[Node], None], panel: bool = False) -> None:
    await node.start()
    ready(node)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(node.run())
        tg.create_task(show_panel(node) if panel else show_lines(node))


ACTIVITY_S = 10.0  # a headless node's line of the steps it ran, this often while it works


async def show_lines(node: Node, every_s: float = ACTIVITY_S) -> None:
    """A headless node's line of work done: every `every_s` while it runs steps (clients
    connecting and leaving, plans loaded and unloaded are the node's own log lines)."""
    runs, ms, since = node.store.runs, node.store.run_ms_total, time.monotonic()
    while True:
        await asyncio.sleep(every_s)
        st = node.store
        if st.runs > runs:
            n = st.runs - runs
            print(f"ran {n} steps in the last {time.monotonic() - since:.0f} s "
                  f"({(st.run_ms_total - ms) / n:.1f} ms each); {len(st.sessions)} sessions, "
                  f"KV {st.kv_bytes / 2**20:.1f} MiB", flush=True)
        runs, ms, since = st.runs, st.run_ms_total, time.monotonic()


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


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    c = NodeConfig
    n = sub.add_parser("node", parents=parents, formatter_class=options.HelpFormatter,
                       help="run a stage node")
    n.add_argument("--host", default="0.0.0.0", help="address to listen on")
    n.add_argument("--port", type=options.port_number, default=c.port, help="0 = any free port (printed)")
    n.add_argument("--data-dir", type=Path, default=paths.home(),
                   help="where deployed layer files are kept ($EDGELITE_HOME, else ~/.edgelite)")
    r = RuntimeConfig
    n.add_argument("--threads", type=options.thread_count, default=r.threads, help="onnxruntime threads")
    n.add_argument("--no-spin", action="store_true",
                   help="idle onnxruntime threads sleep at once (when processes share cores)")
    n.add_argument("--provider", choices=sorted(PROVIDERS), default=r.provider,
                   help="onnxruntime execution provider (xnnpack, nnapi: where the build has them)")
    n.add_argument("--kv-buckets", default=",".join(map(str, r.kv_buckets)),
                   help="KV capacities sessions are accounted in; the largest caps the context")
    options.kv_store_flags(n, "DATA_DIR/kv")
    n.add_argument("--token", help="cluster token (default: $EDGELITE_TOKEN, else generated)")
    n.add_argument("--kv-budget-mb", type=options.mebibytes, default=c.kv_budget_bytes / 2**20,
                   help="KV memory of all sessions")
    n.add_argument("--max-batch", type=int, default=c.batch_max_steps,
                   help="decode steps of different sessions arriving together run as one batch "
                        "of up to this many (1: never batch); with the invariant default only "
                        "where each session's rows are computed as alone (edgelite's operators)")
    n.add_argument("--no-invariant", action="store_true",
                   help="let a step's rows depend on how many run together: decode batches of "
                        "several sessions also where onnxruntime's operators run them, decode "
                        "slightly faster at long contexts, but a reply may then depend on load, "
                        "chunking and the KV store (fast mode)")
    options.kv_dtype_flag(n)
    options.attention_flag(n)
    n.add_argument("--memory-mb", type=options.mebibytes,
                   help="the most this node process may hold, in MiB: plans count against it what "
                        "they hold once loaded, and a load or session beyond it is refused "
                        "(default: the device's free memory)")
    n.add_argument("--name", help="device name shown to the client")
    n.add_argument("--discovery-port", type=options.port_number, default=NodeConfig.discovery_port,
                   help="UDP port where this node answers clients looking for nodes with "
                        "--nodes auto (0: it does not answer)")
    n.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="any other limit or timeout of the node's config (NodeConfig in "
                        "edgelite/config.py), e.g. --set disk_quota_bytes=4000000000 "
                        "--set owner_grace_s=5")
    n.add_argument("--plain", action="store_true", help="log lines only, no live panel (default "
                                                        "when stdout is not a terminal)")
    n.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    token, generated = resolve_token(args.token)
    runtime = RuntimeConfig(threads=args.threads, provider=args.provider, allow_spinning=not args.no_spin,
                            invariant=not args.no_invariant, kv_dtype=options.kv_dtype(args),
                            attention_kernel=not args.no_attention_kernel,
                            matmul_kernel=not args.no_matmul_kernel,
                            kv_buckets=options.int_list(args.kv_buckets, "--kv-buckets"),
                            kv_store=options.kv_store_config(args))
    providers(runtime)  # a clear error now when this onnxruntime lacks the provider
    settings = dict(host=args.host, port=args.port, runtime=runtime,
                    discovery_port=args.discovery_port,
                    kv_budget_bytes=int(args.kv_budget_mb * 2**20),
                    batch_max_steps=max(1, args.max_batch),
                    memory_budget_bytes=None if args.memory_mb is None else int(args.memory_mb * 2**20))
    cfg = NodeConfig(**{**settings, **options.config_overrides(args.set, NodeConfig)})
    held, budget = resident_bytes(), cfg.memory_budget_bytes
    if budget is not None and held is not None and budget < held + cfg.memory_min_room_bytes:
        least = (held + cfg.memory_min_room_bytes) / 2**20
        raise EdgeliteError(f"--memory-mb {args.memory_mb:g}: this node process holds {held / 2**20:.0f} "
                            f"MiB already, so no layer would ever fit; give it at least {least:.0f} "
                            f"(a layer of a 1 B int4 model holds ~40 MiB)")
    try:
        args.data_dir.mkdir(parents=True, exist_ok=True)
        probe = args.data_dir / ".write-test"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise EdgeliteError(f"--data-dir {args.data_dir}: cannot write there "
                            f"({exc.strerror or exc})") from None
    node = Node(cfg, token, args.data_dir, **({"name": args.name} if args.name else {}))
    panel = not args.plain and sys.stdout.isatty()
    if not panel and not getattr(args, "verbose", 0):  # headless: say what happens
        logging.getLogger("edgelite.node").setLevel(logging.INFO)
        logging.getLogger("edgelite.engine.kernels").setLevel(logging.INFO)

    def ready(n: Node) -> None:
        if generated:
            print(f"cluster token (pass it to the client as --token or EDGELITE_TOKEN): {n.token}")
        lan = lan_address() if n.cfg.host in ANY_HOST else None
        reach = f" (on the LAN: {lan}:{n.port})" if lan else ""
        print(f"edgelite node {n.name} listening on {n.cfg.host}:{n.port}{reach}", flush=True)

    with contextlib.suppress(KeyboardInterrupt):
        runner.run(serve(node, ready, panel))
    return 0
