"""The KV store on SmolLM2 (int4): resume after a full restart, a shared prefix, preemption swap.

The client holds layers 0-9, two node processes 10-19 and 20-29 (1 thread each, loopback).
- resume: a ~1,000-token conversation's next turn after every process restarted (a new client;
  the nodes killed and started again on their data folders), importing its KV from the stores,
  over the same turn computing the whole history on freshly restarted processes; and the ids
  against the same conversation run without a restart.
- shared prefix: a second session whose prompt shares a 500-token prefix with the first's
  (time to first token, i.e. its prefill, over the first's); ids against no sharing.
- move: the conversation's next turn on plans that split the model otherwise: the two nodes
  re-split (10-14, 15-29: layers 15-19 taken over from the other node), then a third node in
  place of the second (15-29 fetched from it); time to first token over computing the whole
  history on the same plan, and the ids against it and against the same turns on the first plan.
- preemption: `edgelite serve` with a KV budget that forces preemptions, the same requests with
  swap and without: outputs, swapped-in vs recomputed tokens.
- gateway: a conversation's second turn with and without prefix reuse (TTFT); and a long
  reply's gaps between tokens while requests with long prompts come and go, with and without
  reuse (what storing and looking up KV costs the other streams).
Rounds interleave; medians. Prints one JSON object.

    python scripts/bench_kvstore.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import itertools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench_local import edgelite_export

import edgelite
from edgelite.cli.localnodes import TOKEN, NodeProc, start_node, start_serve, stop_serve
from edgelite.config import GenerationConfig
from edgelite.ids import NodeAddr
from edgelite.manifest import load
from edgelite.planner.model import Plan, Stage
from edgelite.reply.tokenizer import Tokenizer
from edgelite.serve.client import GatewayClient

ROOT = Path(__file__).resolve().parent.parent
RANGES = [(10, 19), (20, 29)]
NEW_TURN = "\n\nQuestion: so what does a node keep on its disk?\nAnswer:"  # the next turn


def plan_for(nodes: list[NodeProc], ranges: list[tuple[int, int]] = RANGES) -> Plan:
    stages = [Stage(f"node{i}", a, b, NodeAddr.parse(n.addr)) for i, (n, (a, b)) in
              enumerate(zip(nodes, ranges, strict=True))]
    return Plan((Stage("client", 0, 9), *stages), "latency", "split", "given")


async def turn(model: Path, nodes: list[NodeProc], prompt: list[int], n: int,
               reuse: bool = True, plan: Plan | None = None) -> dict[str, Any]:
    """A reply on a new client (a restarted one: its store is read from disk)."""
    async with edgelite.connect(model, nodes=[x.addr for x in nodes], token=TOKEN,
                                plan=plan or plan_for(nodes)) as llm:
        r = llm.complete(prompt, max_tokens=n, reuse=reuse)
        await r.collect()
        return {"ids": r.token_ids, "ttft_ms": r.stats.ttft_ms, "reused": r.stats.reused_tokens}


def start(dirs: list[Path]) -> list[NodeProc]:
    return [start_node(d, threads=1, kv_budget_mb=512, extra=("--no-spin",)) for d in dirs]


def stop(nodes: list[NodeProc]) -> None:
    for n in nodes:
        n.kill()


def resume_round(model: Path, tmp: Path, ids: list[int], r: int, history: int,
                 new: list[int]) -> dict[str, Any]:
    first = ids[r * 7:r * 7 + history]
    out: dict[str, Any] = {}
    for case in ("straight", "restarted"):
        os.environ["EDGELITE_HOME"] = str(tmp / f"home-{case}-{r}")
        dirs = [tmp / f"{case}-{r}-{i}" for i in range(2)]
        nodes = start(dirs)
        try:
            reply1 = asyncio.run(turn(model, nodes, first, 8))["ids"]
            prompt2 = first + reply1 + new
            if case == "straight":
                out["straight"] = asyncio.run(turn(model, nodes, prompt2, 16))
                continue
            stop(nodes)
            nodes = start(dirs)
            out["recompute"] = asyncio.run(turn(model, nodes, prompt2, 16, reuse=False))
            stop(nodes)
            nodes = start(dirs)
            out["resume"] = asyncio.run(turn(model, nodes, prompt2, 16))
            out["prompt_tokens"] = len(prompt2)
        finally:
            stop(nodes)
    return out


def move_round(model: Path, tmp: Path, ids: list[int], r: int, history: int,
               new: list[int]) -> dict[str, Any]:
    """The same turns twice: on plans that move layers, and (on processes and a home of
    their own) all on the first plan, as if nothing moved."""
    first = ids[100 + r * 7:100 + r * 7 + history]
    os.environ["EDGELITE_HOME"] = str(tmp / f"home-still-{r}")
    still = start([tmp / f"still-{r}-{i}" for i in range(2)])
    os.environ["EDGELITE_HOME"] = str(tmp / f"home-move-{r}")
    nodes = start([tmp / f"move-{r}-{i}" for i in range(3)])
    try:
        reply = asyncio.run(turn(model, nodes[:2], first, 8))["ids"]
        prompt = first + reply + new
        out: dict[str, Any] = {"prompt_tokens": len(prompt)}
        os.environ["EDGELITE_HOME"] = str(tmp / f"home-still-{r}")
        assert asyncio.run(turn(model, still, first, 8))["ids"] == reply
        for case, plan in (("resplit", plan_for(nodes[:2], [(10, 14), (15, 29)])),
                           ("new_node", plan_for([nodes[0], nodes[2]], [(10, 14), (15, 29)]))):
            os.environ["EDGELITE_HOME"] = str(tmp / f"home-still-{r}")
            straight = asyncio.run(turn(model, still, prompt, 16))
            os.environ["EDGELITE_HOME"] = str(tmp / f"home-move-{r}")
            alone = asyncio.run(turn(model, nodes, prompt, 16, reuse=False, plan=plan))
            moved = asyncio.run(turn(model, nodes, prompt, 16, plan=plan))
            out[case] = {"move": moved, "recompute": alone, "straight": straight}
            prompt = prompt + moved["ids"] + new
        return out
    finally:
        stop(nodes)
        stop(still)


def shared_round(model: Path, nodes: list[NodeProc], ids: list[int], r: int) -> dict[str, Any]:
    base = 2000 + r * 600
    prefix = ids[base:base + 500]
    a, b = prefix + ids[base + 500:base + 540], prefix + ids[base + 540:base + 580]
    one = asyncio.run(turn(model, nodes, a, 8))
    two = asyncio.run(turn(model, nodes, b, 8))
    alone = asyncio.run(turn(model, nodes, b, 8, reuse=False))
    return {"first": one, "second": two, "second_alone": alone}


async def gateway_requests(port: int, prompts: list[str], tokens: int) -> tuple[list[list[int]], dict]:
    async def one(prompt: str) -> list[int]:
        c = await GatewayClient.connect(NodeAddr("127.0.0.1", port), "u", "t-u")
        try:
            async for _ in c.generate([{"role": "user", "content": prompt}],
                                      GenerationConfig(max_tokens=tokens)):
                pass
            assert c.last is not None
            return c.last.token_ids
        finally:
            await c.close()

    outs = await asyncio.gather(*(one(p) for p in prompts))
    c = await GatewayClient.connect(NodeAddr("127.0.0.1", port), "u", "t-u")
    try:
        return list(outs), await c.stats()
    finally:
        await c.close()


@contextlib.contextmanager
def gateway(model: Path, tmp: Path, tag: str, args: list[str], **node_kw: Any) -> Iterator[int]:
    """Two node processes (0-14 / 15-29) and `edgelite serve` over them, with `args`; its port."""
    os.environ["EDGELITE_HOME"] = str(tmp / f"home-{tag}")
    nodes = [start_node(tmp / f"{tag}-{i}", threads=1, extra=("--no-spin",), **node_kw)
             for i in range(2)]
    users = tmp / "users.json"
    users.write_text(json.dumps({"users": [{"name": "u", "token": "t-u", "tier": 1}]}))
    log = (tmp / f"{tag}.log").open("w")
    proc = None
    try:
        proc, found = start_serve(
            ["--model", str(model), "--nodes", ",".join(n.addr for n in nodes), "--split",
             "0-14,15-29", "--users", str(users), "--port", "0", "--threads", "1", *args], log)
        yield int(found.group(1))
    finally:
        if proc is not None:
            stop_serve(proc)
        log.close()
        stop(nodes)


def preemption_run(model: Path, tmp: Path, swap: bool, prompts: list[str], tokens: int) -> dict[str, Any]:
    tag = f"gw-{model.name}-{'swap' if swap else 'recompute'}"
    args = ["--kv-tokens", "700", "--max-preemptions", "100",
            "--set", f"swap_preempted={'true' if swap else 'false'}",
            "--set", "reuse_prefixes=false"]  # (the swap alone)
    with gateway(model, tmp, tag, args, kv_budget_mb=512) as port:
        outs, stats = asyncio.run(gateway_requests(port, prompts, tokens))
    return {"outputs": outs, "preemptions": stats["preemptions"],
            "resumed_tokens": stats["resumed_tokens"]}


def gateway_turns_run(model: Path, tmp: Path, reuse: bool, first: str, tokens: int) -> dict[str, Any]:
    """A conversation's two turns through `edgelite serve`: the second's TTFT (as the gateway
    reports it) with or without `reuse_prefixes`."""

    async def talk(port: int) -> dict[str, Any]:
        c = await GatewayClient.connect(NodeAddr("127.0.0.1", port), "u", "t-u")
        try:
            turns, messages = [], [{"role": "user", "content": first}]
            for question in ("Summarise that in one line.", "Which part matters most?"):
                reply = "".join([p async for p in c.generate(messages, GenerationConfig(max_tokens=tokens))])
                assert c.last is not None
                turns.append({"ttft_ms": c.last.ttft_ms, "ids": c.last.token_ids})
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]
            return {"turns": turns, "reused": (await c.stats())["prompt_tokens_reused"]}
        finally:
            await c.close()

    tag = f"turns-{'reuse' if reuse else 'compute'}"
    with gateway(model, tmp, tag, ["--set", f"reuse_prefixes={'true' if reuse else 'false'}"]) as port:
        return asyncio.run(talk(port))


def stream_gaps_run(model: Path, tmp: Path, reuse: bool, texts: list[str]) -> dict[str, Any]:
    """What the KV store costs other streams in `edgelite serve`: a long reply's gaps between
    tokens while 4 requests with ~800-token prompts come (one after another) and finish."""

    async def run(port: int) -> dict[str, Any]:
        times: list[float] = []

        async def long() -> None:
            c = await GatewayClient.connect(NodeAddr("127.0.0.1", port), "u", "t-u")
            try:
                story = [{"role": "user", "content": "Tell a long story about a lighthouse."}]
                async for _ in c.generate(story, GenerationConfig(max_tokens=300)):
                    times.append(time.monotonic())
            finally:
                await c.close()

        async def others() -> None:
            await asyncio.sleep(1.0)
            for text in texts:
                c = await GatewayClient.connect(NodeAddr("127.0.0.1", port), "u", "t-u")
                try:
                    asked = [{"role": "user", "content": text}]
                    async for _ in c.generate(asked, GenerationConfig(max_tokens=6)):
                        pass
                finally:
                    await c.close()
                await asyncio.sleep(0.3)

        await asyncio.gather(long(), others())
        gaps = sorted((b - a) * 1e3 for a, b in itertools.pairwise(times))
        return {"tokens": len(times), "median_gap_ms": round(statistics.median(gaps), 1),
                "p99_gap_ms": round(gaps[int(0.99 * (len(gaps) - 1))], 1), "max_gap_ms": round(gaps[-1], 1)}

    tag = f"gaps-{'reuse' if reuse else 'compute'}"
    with gateway(model, tmp, tag, ["--set", f"reuse_prefixes={'true' if reuse else 'false'}"]) as port:
        return asyncio.run(run(port))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--history", type=int, default=990, help="tokens of the first turn's prompt")
    ap.add_argument("--models", type=Path, default=ROOT / "models" / "bench")
    ap.add_argument("--skip-gateway", action="store_true")
    args = ap.parse_args()
    model = edgelite_export(args.models / "smol-int4-fast")
    tok = Tokenizer(load(model))
    text = "\n".join((ROOT / p).read_text() for p in ("docs/architecture.md", "README.md",
                                                        "../shared/DESIGN.md") if (ROOT / p).is_file())
    ids = tok.encode(text)
    new_turn = tok.encode(NEW_TURN)
    os.environ["EDGELITE_TOKEN"] = TOKEN  # (edgelite serve reads it)
    tmp = Path(tempfile.mkdtemp(prefix="edgelite-bench-kv-"))
    atexit.register(shutil.rmtree, tmp, True)  # (the nodes' KV stores: GBs after a run)
    resume, shared, move = [], [], []
    shared_nodes = None
    try:
        os.environ["EDGELITE_HOME"] = str(tmp / "home-shared")
        shared_nodes = start([tmp / f"shared-{i}" for i in range(2)])
        asyncio.run(turn(model, shared_nodes, ids[:64], 2, reuse=False))  # warm up
        for r in range(args.rounds):
            resume.append(resume_round(model, tmp, ids, r, args.history, new_turn))
            move.append(move_round(model, tmp, ids, r, args.history, new_turn))
            os.environ["EDGELITE_HOME"] = str(tmp / "home-shared")
            shared.append(shared_round(model, shared_nodes, ids, r))
    finally:
        if shared_nodes:
            stop(shared_nodes)
    out: dict[str, Any] = {
        "model": "SmolLM2-135M int4 (fast)", "split": "client 0-9, node 10-19, node 20-29",
        "rounds": args.rounds, "new_turn_tokens": len(new_turn),
        "resume_ttft_ratio": statistics.median(x["resume"]["ttft_ms"] / x["recompute"]["ttft_ms"]
                                               for x in resume),
        "resume": [{"prompt_tokens": x["prompt_tokens"], "reused": x["resume"]["reused"],
                    "resume_ttft_ms": round(x["resume"]["ttft_ms"], 1),
                    "recompute_ttft_ms": round(x["recompute"]["ttft_ms"], 1),
                    "ids_equal_uninterrupted": x["resume"]["ids"] == x["straight"]["ids"],
                    "ids_equal_recompute": x["resume"]["ids"] == x["recompute"]["ids"]}
                   for x in resume],
        "shared_prefix_prefill_ratio": statistics.median(
            x["second"]["ttft_ms"] / x["first"]["ttft_ms"] for x in shared),
        "shared": [{"first_ttft_ms": round(x["first"]["ttft_ms"], 1),
                    "second_ttft_ms": round(x["second"]["ttft_ms"], 1),
                    "second_reused": x["second"]["reused"],
                    "ids_equal_without_sharing": x["second"]["ids"] == x["second_alone"]["ids"]}
                   for x in shared]}
    for case in ("resplit", "new_node"):
        out[f"move_{case}_ttft_ratio"] = statistics.median(
            x[case]["move"]["ttft_ms"] / x[case]["recompute"]["ttft_ms"] for x in move)
        out[f"move_{case}"] = [{"prompt_tokens": x["prompt_tokens"], "reused": x[case]["move"]["reused"],
                                "move_ttft_ms": round(x[case]["move"]["ttft_ms"], 1),
                                "recompute_ttft_ms": round(x[case]["recompute"]["ttft_ms"], 1),
                                "ids_equal_unmoved": x[case]["move"]["ids"] == x[case]["straight"]["ids"],
                                "ids_equal_recompute": x[case]["move"]["ids"] == x[case]["recompute"]["ids"]}
                               for x in move]
    if not args.skip_gateway:
        prompts = [f"Tell me about item {i}: " + tok.decode(ids[3000 + 90 * i:3000 + 90 * i + 80])
                   for i in range(6)]
        out["preemption"] = {}
        exact = edgelite_export(args.models / "smol-int4-exact", "--mode", "exact")
        for name, m in (("fast", model), ("exact", exact)):
            runs = {swap: preemption_run(m, tmp, swap, prompts, 48) for swap in (True, False)}
            out["preemption"][name] = {
                "requests": len(prompts), "max_tokens": 48,
                "preemptions": {"swap": runs[True]["preemptions"], "recompute": runs[False]["preemptions"]},
                "swap": runs[True]["resumed_tokens"], "recompute": runs[False]["resumed_tokens"],
                "outputs_equal": sum(a == b for a, b in zip(runs[True]["outputs"], runs[False]["outputs"],
                                                            strict=True))}
        first = tok.decode(ids[5000:5500])
        turns = {reuse: gateway_turns_run(model, tmp, reuse, first, 16) for reuse in (True, False)}
        out["gateway_next_turn"] = {
            "first_prompt_tokens": 500,
            "second_turn_ttft_ms": {"reuse": turns[True]["turns"][1]["ttft_ms"],
                                    "compute": turns[False]["turns"][1]["ttft_ms"]},
            "first_turn_ttft_ms": {"reuse": turns[True]["turns"][0]["ttft_ms"],
                                   "compute": turns[False]["turns"][0]["ttft_ms"]},
            "prompt_tokens_reused": turns[True]["reused"],
            "ids_equal": [a["ids"] == b["ids"] for a, b in zip(turns[True]["turns"], turns[False]["turns"],
                                                             strict=True)]}
        texts = [tok.decode(ids[6000 + 800 * i:6000 + 800 * i + 780]) + "\nSummarise." for i in range(4)]
        gaps = {reuse: stream_gaps_run(model, tmp, reuse, texts) for reuse in (True, False)}
        out["gateway_stream_gaps"] = {"reuse": gaps[True], "compute": gaps[False]}
        out["preemption_recomputed_tokens"] = {
            name: {"with_swap": p["swap"]["recomputed"], "without_swap": p["recompute"]["recomputed"]}
            for name, p in out["preemption"].items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
