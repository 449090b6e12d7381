"""`edgelite generate`: one reply to one prompt, streamed (or one JSON object)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

import edgelite
from edgelite.cli import jsonout, options, runner, views
from edgelite.errors import EdgeliteError


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    g = sub.add_parser("generate", parents=parents, formatter_class=options.HelpFormatter,
                       help="generate a reply to one prompt")
    options.model_flags(g)
    options.generation_flags(g)
    options.cluster_flags(g)
    g.add_argument("--json", action="store_true", help="print one JSON object with the result")
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--tools", type=Path, metavar="FILE",
                   help="tools the reply may call: a JSON file holding OpenAI's `tools` list (a "
                        "call is printed as {\"name\", \"arguments\"} and finish is tool_calls)")
    g.add_argument("--tool-choice", default="auto", metavar="auto|none|required|NAME",
                   help="with --tools: whether the reply may (auto), must (required, or that "
                        "tool's NAME) or must not (none) call one")
    g.add_argument("prompt")
    g.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    result = runner.run(generate(args, None if args.json else sys.stdout))
    if args.json:
        print(jsonout.dumps(result))
    else:
        print()
        if result["finish"] == "length":  # (on stderr: stdout holds the reply alone)
            print(f"[cut at --max-tokens {args.max_tokens}: raise it for a longer reply]",
                  file=sys.stderr)
    return 0


async def generate(args: argparse.Namespace, stream: TextIO | None) -> dict[str, Any]:
    console = views.stderr_console()
    with views.connect_bars(console, live=console.is_terminal and stream is not None) as progress:
        llm = await edgelite.connect(args.model, **options.connect_kwargs(args), progress=progress)
    views.unreachable(console, llm.probed)
    async with llm:
        if stream is not None:
            views.explain_plan(console, llm.plan, llm.probed)
        tools = tools_text(args)
        reply = (llm.complete(args.prompt) if args.raw
                 else llm.chat([{"role": "user", "content": args.prompt}], tools=tools,
                               tool_choice=args.tool_choice))
        async for piece in reply:
            if stream is not None:
                stream.write(piece.text)
                stream.flush()
    st = reply.stats
    if st.tool_call and stream is not None:
        stream.write(st.tool_call)
    out: dict[str, Any] = {"text": reply.text, "token_ids": st.token_ids,
                           "prompt_tokens": st.prompt_tokens, "ttft_ms": round(st.ttft_ms, 2),
                           "decode_tok_s": round(st.decode_tok_s, 2), "finish": st.finish}
    if st.tool_call:
        out["tool_call"] = json.loads(st.tool_call)
    if st.drafted:
        out["speculation"] = {"drafted": st.drafted, "accepted": st.accepted,
                              "acceptance": round(st.acceptance, 3),
                              "tokens_per_step": round(st.tokens_per_step, 2)}
    if st.decode_s > 0 and len(st.token_ids) > 1:
        out["decode_ms_per_token"] = round(st.decode_s / (len(st.token_ids) - 1) * 1e3, 3)
    if llm.plan is not None and llm.plan.solver != "local":
        out["plan"] = llm.plan.to_json()
    return out


def tools_text(args: argparse.Namespace) -> str:
    """--tools FILE's text ("" without it)."""
    if args.tools is None:
        if args.tool_choice != "auto":
            raise EdgeliteError("--tool-choice goes with --tools FILE")
        return ""
    if args.raw:
        raise EdgeliteError("--tools needs the chat template: leave --raw out")
    try:
        return args.tools.read_text()
    except OSError as exc:
        raise EdgeliteError(f"--tools {args.tools}: {exc.strerror or exc}") from None
