"""SmolLM2-135M: 3-node pipeline vs the single-process chain, and pipelined concurrency.

All node processes run on this machine (loopback). Configurations alternate round by round.
Prints one JSON object. Usage: python scripts/bench_pipeline.py [--rounds 3] [--tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from edgelite import manifest as mf
from edgelite.cluster import ClusterBackend, in_order, open_cluster
from edgelite.config import GenerationConfig, RuntimeConfig
from edgelite.engine import LocalBackend, Stats, generate
from edgelite.localnodes import TOKEN, start_node
from edgelite.nodeapp import install_uvloop
from edgelite.tokenizer import Tokenizer

PROMPT = "Write a short story about a robot who learns to paint."


async def decode_ms(backend, prompt: list[int], n: int) -> float:
    stats = Stats()
    cfg = GenerationConfig(max_tokens=n)
    async for _ in generate(backend, prompt, cfg, stats):
        pass
    return stats.decode_s / max(1, len(stats.token_ids) - 1) * 1e3


async def aggregate_tok_s(backend, prompts: list[list[int]], n: int) -> float:
    t0 = time.perf_counter()
    cfg = GenerationConfig(max_tokens=n)

    async def one(p: list[int]) -> int:
        return len([t async for t in generate(backend, p, cfg)])

    done = await asyncio.gather(*(one(p) for p in prompts))
    return sum(done) / (time.perf_counter() - t0)


async def cluster(m: mf.Manifest, ports: list[int], split: list[tuple[int, int]]) -> ClusterBackend:
    return await open_cluster(m, [("127.0.0.1", p) for p in ports], in_order(split), TOKEN, threads=1)


async def ping_us(be: ClusterBackend, n: int = 200) -> float:
    link = be.cluster.links[0]
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await link.request({"type": "ping"}, 5)
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


async def main_async(args: argparse.Namespace) -> dict:
    model = args.models / "smollm2-135m"
    if not (model / "manifest.json").is_file():
        from edgelite_export import build

        build.run("smollm2-135m", model, build.Options())
    m = mf.load(model)
    prompt = Tokenizer(m).chat_prompt([{"role": "user", "content": PROMPT}])
    tmp = Path(tempfile.mkdtemp(prefix="edgelite-bench-"))
    nodes = [start_node(tmp / f"n{i}", threads=1) for i in range(5)]
    try:
        local = LocalBackend(m, RuntimeConfig(threads=1))
        three = await cluster(m, [n.port for n in nodes[:3]], [(0, 9), (10, 19), (20, 29)])
        two = await cluster(m, [n.port for n in nodes[3:]], [(0, 14), (15, 29)])
        res: dict[str, list[float]] = {"local_ms": [], "pipe3_ms": [], "one_tok_s": [],
                                       "four_tok_s": []}
        prompts = [prompt[:-k] if k else prompt for k in range(4)]  # 4 different sessions
        for _ in range(args.rounds):
            res["local_ms"].append(await decode_ms(local, prompt, args.tokens))
            res["pipe3_ms"].append(await decode_ms(three, prompt, args.tokens))
            res["one_tok_s"].append(await aggregate_tok_s(two, prompts[:1], args.tokens))
            res["four_tok_s"].append(await aggregate_tok_s(two, prompts, args.tokens))
        rtt = await ping_us(three)
        await three.close()
        await two.close()
    finally:
        for n in nodes:
            n.kill()
    med = {k: statistics.median(v) for k, v in res.items()}
    return {
        "model": m.name, "tokens": args.tokens, "rounds": args.rounds, "threads_per_node": 1,
        "single_process_decode_ms_per_token": round(med["local_ms"], 2),
        "pipeline_3_nodes_decode_ms_per_token": round(med["pipe3_ms"], 2),
        "pipeline_vs_single_ratio": round(med["pipe3_ms"] / med["local_ms"], 3),
        # each round runs both back to back: the median of the per-round ratios is less
        # sensitive to the machine's speed drifting between rounds
        "pipeline_vs_single_ratio_paired_median": round(statistics.median(
            p / q for p, q in zip(res["pipe3_ms"], res["local_ms"], strict=True)), 3),
        "per_hop_overhead_us_median": round((med["pipe3_ms"] - med["local_ms"]) * 1e3 / 4, 1),
        "ping_rtt_us_median": round(rtt, 1),
        "two_nodes_one_session_tok_s": round(med["one_tok_s"], 2),
        "two_nodes_four_sessions_tok_s": round(med["four_tok_s"], 2),
        "four_vs_one_session_ratio": round(med["four_tok_s"] / med["one_tok_s"], 3),
        "raw": {k: [round(x, 3) for x in v] for k, v in res.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--models", type=Path, default=Path("models"))
    install_uvloop()  # the same event loop as `edgelite generate` and the nodes
    print(json.dumps(asyncio.run(main_async(ap.parse_args())), indent=1))


if __name__ == "__main__":
    main()
