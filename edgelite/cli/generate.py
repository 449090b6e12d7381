"""What `edgelite generate` and `edgelite chat` do: pick a backend, tokenize, stream."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TextIO

from edgelite import manifest as mf
from edgelite.config import GenerationConfig, RuntimeConfig
from edgelite.engine.generate import Backend, LocalBackend, Stats, generate
from edgelite.engine.tokenizer import StreamDecoder, Tokenizer


def gen_config(args: argparse.Namespace) -> GenerationConfig:
    return GenerationConfig(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)


async def open_backend(args: argparse.Namespace,
                       manifest: mf.Manifest) -> tuple[Backend, dict[str, Any] | None]:
    """(backend, the plan's JSON when the planner chose one)."""
    if getattr(args, "nodes", None):
        from edgelite.cli.deploy import connect_backend

        return await connect_backend(args, manifest)
    return LocalBackend(manifest, RuntimeConfig(threads=args.threads)), None


def show_plan(plan: dict[str, Any] | None) -> None:
    if plan is not None:
        from edgelite.cli.plan import show

        show(plan, stderr=True)


async def reply(backend: Backend, tok: Tokenizer, prompt: list[int], cfg: GenerationConfig,
                stream: TextIO | None) -> Stats:
    stats = Stats()
    dec = StreamDecoder(tok)
    async for t in generate(backend, prompt, cfg, stats):
        if stream is not None:
            stream.write(dec.push(t))
            stream.flush()
    return stats


async def run_generate(args: argparse.Namespace, stream: TextIO | None) -> dict:
    manifest = mf.load(args.model)
    tok = Tokenizer(manifest)
    prompt = (tok.encode(args.prompt) if args.raw
              else tok.chat_prompt([{"role": "user", "content": args.prompt}]))
    backend, plan = await open_backend(args, manifest)
    if stream is not None:
        show_plan(plan)
    try:
        stats = await reply(backend, tok, prompt, gen_config(args), stream)
    finally:
        await backend.close()
    out = {"text": tok.decode(stats.token_ids), "token_ids": stats.token_ids,
           "prompt_tokens": stats.prompt_tokens, "ttft_ms": round(stats.ttft_ms, 2),
           "decode_tok_s": round(stats.decode_tok_s, 2), "finish": stats.finish}
    if stats.decode_s > 0 and len(stats.token_ids) > 1:
        out["decode_ms_per_token"] = round(stats.decode_s / (len(stats.token_ids) - 1) * 1e3, 3)
    return out if plan is None else {**out, "plan": plan}


def reprobe_for(args: argparse.Namespace, manifest: mf.Manifest) -> Callable[[], Awaitable[dict]] | None:
    """/probe in the chat: measure the cluster again (None when running locally)."""
    if not getattr(args, "nodes", None):
        return None
    from edgelite.probe.cluster import probe_args

    return lambda: probe_args(args, manifest)


async def run_chat(args: argparse.Namespace) -> int:
    from rich.console import Console

    from edgelite.cli import chatui

    manifest = mf.load(args.model)
    plain = args.plain or not sys.stdout.isatty()
    backend, plan = await open_backend(args, manifest)
    if not plain:
        show_plan(plan)
    chat = chatui.Chat(backend, Tokenizer(manifest), gen_config(args), plan,
                       reprobe_for(args, manifest))
    try:
        return await chatui.run(chat, Console(), plain)
    finally:
        await backend.close()
