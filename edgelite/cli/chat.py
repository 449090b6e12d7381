"""`edgelite chat`: an interactive chat with the model (local, on nodes, or through a gateway)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import edgelite
from edgelite.cli import chatui, options, runner, views
from edgelite.cli.keyboard import Keyboard
from edgelite.client import sessions
from edgelite.errors import EdgeliteError
from edgelite.ids import NodeAddr


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    c = sub.add_parser("chat", parents=parents, formatter_class=options.HelpFormatter,
                       help="interactive chat")
    options.model_flags(c, required=False)
    options.generation_flags(c)
    options.cluster_flags(c)
    c.add_argument("--gateway", help="HOST:PORT of an `edgelite serve` gateway (no model needed)")
    c.add_argument("--user", help="your user name on the gateway")
    c.add_argument("--user-token", help="your token on the gateway (default: $EDGELITE_USER_TOKEN)")
    c.add_argument("--session", metavar="NAME",
                   help="keep this conversation under NAME and continue it next time (its KV "
                        "comes back from the KV stores: only the new turn is computed)")
    c.add_argument("--plain", action="store_true", help="bare text, no live footer (default "
                                                        "when stdout is not a terminal)")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.gateway:
        return runner.run(gateway_chat(args))
    if args.model is None:
        raise EdgeliteError("chat needs --model DIR (or --gateway HOST:PORT)")
    return runner.run(chat(args))


async def chat(args: argparse.Namespace) -> int:

    plain = args.plain or not sys.stdout.isatty()
    history = sessions.load(args.session) if args.session else []
    console = views.stderr_console()
    with views.connect_bars(console, live=not plain and console.is_terminal) as progress:
        llm = await edgelite.connect(args.model, **options.connect_kwargs(args), progress=progress)
    views.unreachable(console, llm.probed)
    async with llm:
        if not plain:
            views.explain_plan(console, llm.plan, llm.probed)
        reprobe = None
        given = options.nodes(args)
        addrs = [NodeAddr.parse(d["addr"]) for d in (llm.probed or {}).get("devices", [])
                 if d.get("addr")] or (given if isinstance(given, list) else [])
        if addrs:
            token = options.token(args, required=True)
            assert token is not None
            budget = options.client_memory(args)  # (/probe shows it, as the first probe did)
            reprobe = lambda: edgelite.probe(addrs, token, llm.manifest,  # noqa: E731
                                             client_memory_bytes=budget)
        shown = views.labelled_plan(llm.plan, llm.probed)
        return await chatui.run(chatui.Chat(llm, shown, reprobe, history, session=args.session,
                                           label=views.labeller(llm.probed)),
                                views.console(), plain)


async def gateway_chat(args: argparse.Namespace) -> int:
    from edgelite.serve.client import GatewayClient

    token = args.user_token or os.environ.get("EDGELITE_USER_TOKEN")
    if not token or not args.user:
        raise EdgeliteError("chat --gateway needs --user and --user-token (or EDGELITE_USER_TOKEN)")
    client = await GatewayClient.connect(NodeAddr.parse(args.gateway), args.user, token)
    history: list[dict[str, str]] = []
    cfg = options.generation_config(args)
    try:
        async with Keyboard(lambda prompt: print(prompt, end="", flush=True)) as kb:
            while True:
                line = await kb.line("> ")
                if line is None:
                    print()
                    return 130 if kb.quit else 0
                cmd = line.strip()
                if cmd in ("/quit", "/exit"):
                    return 0
                if cmd == "/reset":
                    history.clear()
                    continue
                if cmd == "/stats":
                    print(gateway_stats_text(await client.stats()))
                    continue
                history.append({"role": "user", "content": line})
                parts: list[str] = []
                finished, _ = await kb.interruptible(_stream(client, history, cfg, parts))
                if not finished:
                    print("\n[stopped]")
                    if not parts:
                        history.pop()
                        continue
                history.append({"role": "assistant", "content": "".join(parts)})
                f = client.last
                if finished and f is not None:
                    print(f"\n[{f.ttft_ms or 0:.0f} ms to first token, {f.decode_tok_s:.1f} tok/s, "
                          f"tier {f.tier}]")
    finally:
        await client.close()


async def _stream(client: Any, history: list[dict[str, str]], cfg: Any, parts: list[str]) -> None:
    async for piece in client.generate(history, cfg):
        parts.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()


def gateway_stats_text(st: dict[str, Any]) -> str:
    """A gateway's stats as a few lines (queues, throughput, latency per tier)."""
    q = st.get("queues", {})
    lines = [f"queues: {q.get('waiting', 0)} waiting, {q.get('running', 0)} running, "
             f"{q.get('preempted', 0)} preempted · {st.get('tokens_total', 0)} tokens "
             f"({st.get('tokens_per_s', 0.0):g}/s) · {st.get('preemptions', 0)} preemptions, "
             f"{st.get('cancelled', 0)} cancelled"]
    for tier, t in st.get("tiers", {}).items():
        lines.append(f"tier {tier}: {t.get('done', 0)} done · TTFT p50 {t.get('ttft_ms_p50', 0):g} ms, "
                     f"p99 {t.get('ttft_ms_p99', 0):g} ms · between tokens p50 "
                     f"{t.get('itl_ms_p50', 0):g} ms, p99 {t.get('itl_ms_p99', 0):g} ms")
    return "\n".join(lines)
