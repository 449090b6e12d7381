"""Other users' time to first token with and without a hostile client, through `edgelite serve`
on `--nodes` node processes (default 2; SmolLM2-135M int4, its layers split evenly, loopback).

Rounds alternate between kinds (the order rotates each round): "baseline" (only the ordinary
users), "never_reads" (plus a client that asks for long replies and never reads its socket),
"flood" (plus a client sending requests as fast as it can, far past its limit, reading nothing),
"long_prompt" (plus a user whose prompt is ~1,500 tokens, `--long-items 690`: ~6,000,
prefilled in chunks between the others' decode steps). In each round `--users` ordinary users
each send `--requests` short requests one after another (a random pause of up to 300 ms before
each, the same in every kind of round); their time to first token (send -> first piece) and
gaps between pieces are collected per kind. Prints one JSON object with p50/p99 per kind and
the ratios to the baseline.

    python scripts/bench_gateway.py [--rounds 3] [--users 4] [--requests 4] [--long-items 160]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_local import edgelite_export

from edgelite.cli.localnodes import TOKEN, start_node, start_serve
from edgelite.config import GenerationConfig
from edgelite.errors import EdgeliteError
from edgelite.ids import NodeAddr
from edgelite.net import messages as m
from edgelite.serve.client import GatewayClient

KINDS = ("baseline", "never_reads", "flood", "long_prompt")
USERS = [{"name": f"u{i}", "token": f"t{i}", "tier": 0} for i in range(8)] + [
    {"name": k, "token": f"t-{k}", "tier": 0} for k in ("never_reads", "flood", "long_prompt")]
PROMPTS = ["What is a phone?", "Name three colours.", "Say hello.", "Count to five.",
           "What is the sky?", "Why is grass green?", "Tell me a fact.", "What is rain?"]


def start_gateway(model: Path, nodes: list, users: Path, log: Path,
                  settings: list[str]) -> tuple[subprocess.Popen, int]:
    per = 30 // len(nodes)  # (SmolLM2's 30 layers, in even ranges, the last taking the rest)
    split = ",".join(f"{i * per}-{29 if i == len(nodes) - 1 else (i + 1) * per - 1}"
                     for i in range(len(nodes)))
    with log.open("w") as err:
        try:
            proc, found = start_serve(
                ["--model", str(model), "--nodes", ",".join(n.addr for n in nodes), "--split",
                 split, "--token", TOKEN, "--port", "0", "--users", str(users),
                 "--threads", "1", "--no-spin", *(x for kv in settings for x in ("--set", kv))],
                err, timeout=120)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: " + log.read_text()[-2000:]) from None
    return proc, int(found.group(1))


def log_tail(log: Path) -> str:
    return "\n".join(line for line in log.read_text().splitlines()[-40:])


async def user(addr: NodeAddr, who: dict, requests: int, ttft: list[float], gaps: list[float],
               seed: int) -> None:
    """One ordinary user: requests one after another, with a random pause (0-300 ms) before
    each (the same pauses in every kind of round), so users do not all arrive at once."""
    rng = random.Random(seed)
    c = await GatewayClient.connect(addr, who["name"], who["token"])
    try:
        for i in range(requests):
            await asyncio.sleep(rng.uniform(0.0, 0.3))
            rid = 1000 + i
            t0 = time.perf_counter()
            await c.conn.send(m.GenerateRequest(id=rid, prompt=PROMPTS[i % len(PROMPTS)],
                                                max_tokens=24, temperature=0.0))
            last = None
            while True:
                msg = await c.conn.recv()
                if getattr(msg, "id", None) != rid:
                    continue
                now = time.perf_counter()
                if isinstance(msg, m.TokenPiece):
                    if last is None:
                        ttft.append((now - t0) * 1e3)
                    else:
                        gaps.append((now - last) * 1e3)
                    last = now
                elif isinstance(msg, m.Done):
                    break
                else:
                    raise RuntimeError(f"{who['name']}: {getattr(msg, 'message', msg.TYPE)}")
    finally:
        await c.close()


async def hostile(addr: NodeAddr, kind: str, stop: Any, ready: Any, items: int) -> None:  # mp Events
    """The hostile client of a round (in a process of its own: its CPU is not the users').
    `ready` is set once it is at it (its requests sent)."""
    bad = next(u for u in USERS if u["name"] == kind)
    if kind == "never_reads":
        c = await GatewayClient.connect(addr, bad["name"], bad["token"])
        for i in range(8):
            await c.conn.send(m.GenerateRequest(id=2**50 + i, prompt="Tell me a long story.",
                                                max_tokens=400))
        ready.set()
        await asyncio.to_thread(stop.wait)
        await c.close()
    elif kind == "flood":
        sent = 0
        while not stop.is_set() and sent < 1_000_000:
            try:
                c = await GatewayClient.connect(addr, bad["name"], bad["token"])
            except (OSError, EdgeliteError):  # cut off for flooding: try again soon
                await asyncio.sleep(0.05)
                continue
            with contextlib.suppress(ConnectionError, OSError):
                while not stop.is_set():
                    ready.set()
                    for _ in range(100):
                        await c.conn.send(m.GenerateRequest(id=sent, prompt="Say hi.", max_tokens=64))
                        sent += 1
                    await asyncio.sleep(0.005)
            await c.close()
    elif kind == "long_prompt":
        c = await GatewayClient.connect(addr, bad["name"], bad["token"])
        long_text = " ".join(f"item {i} is a thing;" for i in range(items))  # 160: ~1,400 tokens
        ready.set()
        n = 0
        while not stop.is_set():  # (each one new at its start: read, not found in the KV store)
            n += 1
            async for _ in c.generate([{"role": "user", "content": f"List {n}. {long_text}"}],
                                      GenerationConfig(max_tokens=8)):
                pass
        await c.close()


def hostile_process(port: int, kind: str, stop: Any, ready: Any, items: int) -> None:
    asyncio.run(hostile(NodeAddr("127.0.0.1", port), kind, stop, ready, items))


def pct(xs: list[float], q: float) -> float:
    return round(float(np.percentile(xs, q)), 1) if xs else float("nan")


async def run(port: int, rounds: int, users: int, requests: int, kinds: tuple[str, ...],
              items: int) -> dict:
    addr = NodeAddr("127.0.0.1", port)
    ttft: dict[str, list[float]] = {k: [] for k in kinds}
    gaps: dict[str, list[float]] = {k: [] for k in kinds}
    await user(addr, USERS[0], 2, [], [], 0)  # warm up
    for r in range(rounds):
        order = list(kinds[r % len(kinds):] + kinds[:r % len(kinds)])
        for kind in order:
            ctx = mp.get_context("spawn")
            stop, ready = ctx.Event(), ctx.Event()
            bad = None
            if kind != "baseline":
                bad = ctx.Process(target=hostile_process, args=(port, kind, stop, ready, items),
                                  daemon=True)
                bad.start()
                await asyncio.to_thread(ready.wait, 60)
                await asyncio.sleep(1.0)  # its requests are in (running, or being refused)
            try:
                await asyncio.gather(*(user(addr, USERS[i], requests, ttft[kind], gaps[kind],
                                            seed=1000 * r + i) for i in range(users)))
            finally:
                stop.set()
                if bad is not None:
                    await asyncio.to_thread(bad.join, 30)
                    if bad.is_alive():
                        bad.kill()
            await asyncio.sleep(1.0)  # the hostile client's leftovers are cancelled
    base99 = pct(ttft["baseline"], 99) if "baseline" in kinds else float("nan")
    return {k: {"ttft_ms_p50": pct(ttft[k], 50), "ttft_ms_p99": pct(ttft[k], 99),
                "gap_ms_p50": pct(gaps[k], 50), "gap_ms_p99": pct(gaps[k], 99),
                "gap_ms_max": round(max(gaps[k]), 1) if gaps[k] else None,
                "samples": len(ttft[k]), "ttft_ms_p90": pct(ttft[k], 90),
                "ttft_ms_top3": [round(x) for x in sorted(ttft[k])[-3:]],
                "ttft_p99_vs_baseline": round(pct(ttft[k], 99) / base99, 2)} for k in kinds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--models", type=Path, default=Path("models/bench"))
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="gateway settings (edgelite serve --set)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="which kinds of round, e.g. baseline")
    ap.add_argument("--long-items", type=int, default=160, help="the long prompt's items (~9 tokens each)")
    ap.add_argument("--nodes", type=int, default=2, help="node processes (SmolLM2's layers split evenly)")
    args = ap.parse_args()
    kinds = tuple(args.kinds.split(","))
    if unknown := set(kinds) - set(KINDS):
        ap.error(f"unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    model = edgelite_export(args.models / "smol-int4-fast")
    tmp = Path(tempfile.mkdtemp())
    users = tmp / "users.json"
    users.write_text(json.dumps({"users": USERS}))
    nodes = [start_node(tmp / f"n{i}", threads=1, extra=("--no-spin",)) for i in range(args.nodes)]
    gw, port = start_gateway(model, nodes, users, tmp / "gateway.log", args.set)
    try:
        out = asyncio.run(run(port, args.rounds, args.users, args.requests, kinds, args.long_items))
    except BaseException:
        print(log_tail(tmp / "gateway.log"), file=sys.stderr)
        raise
    finally:
        gw.kill()
        gw.wait(10)
        for n in nodes:
            n.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"model": "SmolLM2-135M int4 (fast)", "nodes": args.nodes, "users": args.users,
                      "gateway_settings": args.set,
                      "requests_each": args.requests, "rounds": args.rounds,
                      "long_items": args.long_items, "results": out},
                     indent=1))


if __name__ == "__main__":
    main()
