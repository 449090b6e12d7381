"""The interactive chat: streams each reply with a live footer and answers slash commands.

It reads state (the backend's cluster, the plan, generation stats) and renders it with the views
in ui.py; with `plain` it writes bare text (scripts, no TTY).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from edgelite.cli import views as ui
from edgelite.cli.keyboard import Keyboard
from edgelite.client import sessions
from edgelite.client.llm import LLM, Reply
from edgelite.reply.loop import Stats

HELP = "/plan  /stats  /probe  /reset  /quit"


@dataclass
class Chat:
    llm: LLM
    plan: dict[str, Any] | None = None
    reprobe: Callable[[], Awaitable[dict[str, Any]]] | None = None
    history: list[dict[str, str]] = field(default_factory=list)
    last: dict[str, Any] = field(default_factory=dict)  # the last reply's figures
    stages: list[dict[str, Any]] = field(default_factory=list)  # node stats after the last reply
    label: Callable[[str], str] = str  # a display name for a node address
    session: str | None = None  # kept on disk under this name after every reply

    def keep(self) -> None:
        if self.session is not None:
            sessions.save(self.session, self.history)

    async def node_stats(self) -> list[dict[str, Any]]:
        """Each node's stats, named by the address the client uses; [] when running locally."""
        return [{**s, "name": self.label(str(addr))}
                for addr, s in (await self.llm.node_stats()).items()]

    def health(self) -> dict[str, str]:
        backend = self.llm.cluster
        if backend is None:
            return {}
        cluster = backend.cluster
        return {self.label(str(a)): cluster.lost.get(a, "ok") for a in cluster.links}


def _figures(stats: Stats) -> dict[str, Any]:
    return {"tokens": len(stats.token_ids), "ttft_ms": stats.ttft_ms,
            "decode_tok_s": stats.decode_tok_s, "reused_tokens": stats.reused_tokens,
            **_speculation(stats)}


CUT = "cut at --max-tokens: raise it for longer replies"


def _speculation(stats: Stats) -> dict[str, Any]:
    """Speculation's figures (none when no drafts were offered)."""
    if not stats.drafted:
        return {}
    return {"acceptance": round(stats.acceptance, 3), "tokens_per_step": round(stats.tokens_per_step, 2)}


async def reply(chat: Chat, answer: Reply, console: Console, plain: bool) -> None:
    """Stream the answer to chat.history (its text grows in answer.text as it comes)."""
    stats, text = answer.stats, Text()
    if plain:
        try:
            async for piece in answer:
                console.file.write(piece.text)
                console.file.flush()
        finally:  # (a reply stopped with Ctrl-C keeps its figures for /stats)
            chat.last = _figures(stats)
        reused = f", {stats.reused_tokens} prompt tokens from the KV store" if stats.reused_tokens else ""
        if stats.drafted:
            reused += (f", drafts {stats.acceptance:.0%} accepted, {stats.tokens_per_step:.2f} "
                       f"tokens per step")
        if stats.finish == "length":
            reused += f", {CUT}"
        console.file.write(f"\n[{stats.ttft_ms:.0f} ms to first token, {stats.decode_tok_s:.1f} "
                           f"tok/s{reused}]\n")
        return
    if not chat.stages:  # later replies start from the figures fetched after the last one
        chat.stages = await chat.node_stats()
    with Live(Group(text, ui.footer({}, chat.stages, chat.health())), console=console,
              refresh_per_second=10) as live:
        try:
            async for piece in answer:
                text.append(piece.text)
                live.update(Group(text, ui.footer(_figures(stats), chat.stages, chat.health())))
        finally:  # (a reply stopped with Ctrl-C keeps its figures for /stats)
            chat.last = _figures(stats)
        chat.stages = await chat.node_stats()
        if stats.finish == "length":
            text.append(f" [{CUT}]", style="yellow")
        live.update(Group(text, ui.footer(chat.last, chat.stages, chat.health())))
    console.line()


def _show(console: Console, plain: bool, data: dict[str, Any], view: Callable[[Any], Any]) -> None:
    """A rich view, or one line of JSON when plain."""
    if plain:
        console.file.write(json.dumps(data) + "\n")
    else:
        console.print(view(data))


async def command(chat: Chat, line: str, console: Console, plain: bool) -> bool:
    """Run a slash command; False when the chat should end."""
    cmd = line.split()[0]
    if cmd in ("/quit", "/exit"):
        return False
    if cmd == "/reset":
        chat.history.clear()
        chat.keep()
        console.print("conversation reset")
    elif cmd == "/plan":
        if chat.plan is None:
            console.print("no plan: every layer runs here (or --split was given)")
        else:
            _show(console, plain, chat.plan, ui.plan_view)
    elif cmd == "/stats":
        nodes = await chat.node_stats()
        _show(console, plain, {"last": chat.last, "nodes": nodes},
              lambda d: ui.stats_view(d["last"], d["nodes"]))
    elif cmd == "/probe":
        if chat.reprobe is None:
            console.print("no nodes to probe")
        else:
            result = await chat.reprobe()
            _show(console, plain, result, ui.probe_view)
    else:
        console.print(f"unknown command {cmd}; commands: {HELP}")
    return True


async def run(chat: Chat, console: Console, plain: bool = False) -> int:
    """The chat loop. Ctrl-C during a reply stops it (what was written stays in the
    conversation); Ctrl-C at the prompt ends the chat (exit code 130)."""
    if not plain:
        console.print(f"[dim]commands: {HELP}; Ctrl-C stops a reply, at the prompt it quits[/dim]")
    if chat.session is not None and chat.history:
        turns = sum(1 for m in chat.history if m["role"] == "user")
        console.print(f"session {chat.session}: {turns} turns so far (the last reply: "
                      f"{chat.history[-1]['content'][:60]!r})", markup=False, highlight=False)
    async with Keyboard(lambda prompt: console.print(prompt, end="")) as kb:
        while True:
            line = await kb.line("> " if plain else "[bold cyan]> [/]")
            if line is None:
                console.line()
                return 130 if kb.quit else 0
            if not line.strip():
                continue
            if line.startswith("/"):
                if not await command(chat, line.strip(), console, plain):
                    return 0
                continue
            chat.history.append({"role": "user", "content": line})
            answer = chat.llm.chat(chat.history)
            finished, _ = await kb.interruptible(reply(chat, answer, console, plain))
            if not finished:
                if plain:
                    console.print("\n[stopped]", markup=False, highlight=False)
                else:
                    console.print("\n[yellow]stopped[/yellow]")
                if not answer.text:  # nothing was written: as if the question was not asked
                    chat.history.pop()
                    continue
            chat.history.append({"role": "assistant", "content": answer.text})
            chat.keep()
