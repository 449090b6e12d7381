"""SmolLM2-135M: 2- and 3-node pipelines vs the single-process chain, and pipelined concurrency.

All node processes run on this machine (loopback), whose speed drifts by +-10 % within seconds.
So the single process and the pipelines decode the same prompt side by side, in alternating blocks
of a few tokens (which one goes first alternates too): every block of one is paired with the
other's block of the same tokens at the same context length, run a second apart. Both produce
the same tokens (greedy), so they reach EOS together and start over together.
Per-hop overhead comes from the steps' own timings: the client's round trip minus the time each
stage held the step. Concurrency (4 sessions vs 1 on 2 nodes) runs in alternating rounds.
Prefill: prompts of 60, 300 and 1,000 tokens through the 3 nodes, cut for the pipeline (the
client's default) vs cut as for one stage (chunks of the largest size), taking turns.
Prints one JSON object. Usage: python scripts/bench_pipeline.py [--tokens 384] [--block 8]
[--export int4-fast|fp32] (the int4 export the demo runs, or the fp32 one of the earlier runs)
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_local import edgelite_export

from edgelite import manifest as mf
from edgelite.cli.localnodes import TOKEN, start_node
from edgelite.cli.runner import install_uvloop
from edgelite.client.backend import ClusterBackend, open_backend
from edgelite.client.local import LocalBackend
from edgelite.config import GenerationConfig, RuntimeConfig
from edgelite.ids import NodeAddr
from edgelite.net.steptrace import StepTrace, hop_summary
from edgelite.planner.solve import split_plan
from edgelite.reply.generate import generate
from edgelite.reply.tokenizer import Tokenizer

PROMPT = "Write a short story about a robot who learns to paint."
PREFILL_LENGTHS = (60, 300, 1000)  # prompt tokens (the chat prompt repeated)


async def paired_blocks(backends: list, prompt: list[int], tokens: int, block: int,
                        per_session: int) -> list[list[float]]:
    """ms/token of each backend per block of `block` decode tokens, the backends taking turns on
    the same token positions; `tokens` decode tokens each in all, in sessions of at most
    `per_session` decode tokens (the context stays as short as in a single chat reply)."""
    out: list[list[float]] = [[] for _ in backends]
    gens: list = []
    done = 0
    try:
        while done < tokens:
            if not gens:  # new sessions; the prefill (first token) is not timed
                cfg = GenerationConfig(max_tokens=min(per_session, tokens - done) + 1)
                gens = [generate(be, prompt, cfg) for be in backends]
                firsts = [await anext(g) for g in gens]
                assert len(set(firsts)) == 1, f"backends disagree: {firsts}"
            order = list(range(len(backends)))
            if len(out[0]) % 2:
                order.reverse()
            per, ended = {}, False
            for i in order:
                got = []
                t0 = time.perf_counter()
                for _ in range(block):
                    try:
                        got.append(await anext(gens[i]))
                    except StopAsyncIteration:
                        ended = True
                        break
                per[i] = ((time.perf_counter() - t0) * 1e3 / len(got) if got else 0.0, got)
            if len({tuple(t) for _, t in per.values()}) != 1:
                raise AssertionError("the pipeline's tokens differ from the single process's")
            n = len(per[0][1])
            if n == block:  # a full pair of blocks
                for i, (ms, _) in per.items():
                    out[i].append(ms)
            done += n
            if ended:
                for g in gens:
                    await g.aclose()
                gens = []
    finally:
        for g in gens:
            await g.aclose()
    return out


async def aggregate_tok_s(backend, prompts: list[list[int]], n: int) -> float:
    t0 = time.perf_counter()
    cfg = GenerationConfig(max_tokens=n)

    async def one(p: list[int]) -> int:
        return len([t async for t in generate(backend, p, cfg) if t.token_id is not None])

    done = await asyncio.gather(*(one(p) for p in prompts))
    return sum(done) / (time.perf_counter() - t0)


def time_layers(local: LocalBackend) -> list[float]:
    """Record the single process's decoder-layer time per decode step (ms), to set beside the
    stages' own compute times: the rest of each backend's time is overhead."""
    seconds: list[float] = []
    step = local.chain.layers.run

    def timed(slot, hidden):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = step(slot, hidden)
        if hidden.shape[1] == 1:
            seconds.append((time.perf_counter() - t0) * 1e3)
        return out

    local.chain.layers.run = timed  # type: ignore[method-assign]
    return seconds


async def cluster(m: mf.Manifest, ports: list[int], split: list[tuple[int, int]],
                  runtime: RuntimeConfig | None = None) -> ClusterBackend:
    plan = split_plan(split, [NodeAddr("127.0.0.1", p) for p in ports], m.num_layers)
    backend = await open_backend(m, plan, TOKEN, runtime=runtime or RuntimeConfig(threads=1))
    assert isinstance(backend, ClusterBackend)
    return backend


async def prefill_ms(backends: dict[str, ClusterBackend], prompt: list[int], lengths: tuple[int, ...],
                     rounds: int) -> dict[str, dict[int, list[float]]]:
    """A prompt's prefill (its first token's logits) through each backend, taking turns (who
    goes first alternates), for prompts of each length: ms."""
    out: dict[str, dict[int, list[float]]] = {k: {n: [] for n in lengths} for k in backends}
    for r in range(rounds):
        for n in lengths:
            ids = np.array([(prompt * (n // len(prompt) + 1))[:n]], np.int64)
            for name in (list(backends) if r % 2 == 0 else list(backends)[::-1]):
                t0 = time.perf_counter()
                await backends[name].forward(f"prefill-{r}-{n}", ids)
                out[name][n].append((time.perf_counter() - t0) * 1e3)
                await backends[name].end(f"prefill-{r}-{n}")
    return out


async def ping_us(be: ClusterBackend, n: int = 200) -> float:
    addr = be.plan.stages[0].addr
    assert addr is not None
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await be.cluster.ping(addr, 5)
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


async def main_async(args: argparse.Namespace) -> dict:
    if args.export == "fp32":
        model = edgelite_export(args.models / "smol-fp32", "--quantize", "none")
    else:
        model = edgelite_export(args.models / "smol-int4-fast")  # what the demo runs
    m = mf.load(model)
    prompt = Tokenizer(m).chat_prompt([{"role": "user", "content": PROMPT}])
    tmp = Path(tempfile.mkdtemp(prefix="edgelite-bench-"))
    atexit.register(shutil.rmtree, tmp, True)  # (the nodes' KV stores: GBs after a run)
    # the client's KV store starts empty like the nodes' (in fast mode a prefix taken from a
    # store and a prefix computed in other chunks can differ in the last bits)
    os.environ["EDGELITE_HOME"] = str(tmp / "client")
    nodes = [start_node(tmp / f"n{i}", threads=1) for i in range(5)]
    try:
        local = LocalBackend(m, RuntimeConfig(threads=1))
        three = await cluster(m, [n.port for n in nodes[:3]], [(0, 9), (10, 19), (20, 29)])
        two = await cluster(m, [n.port for n in nodes[3:]], [(0, 14), (15, 29)])
        res: dict[str, list[float]] = {"one_tok_s": [], "four_tok_s": []}
        local_layers_ms = time_layers(local)
        res["local_ms"], res["pipe2_ms"], res["pipe3_ms"] = await paired_blocks(
            [local, two, three], prompt, args.tokens, args.block, args.session_tokens)
        traces: list[StepTrace] = list(three.traces)
        traces2: list[StepTrace] = list(two.traces)
        prompts = [prompt[:-k] if k else prompt for k in range(4)]  # 4 different sessions
        for r in range(args.rounds):
            order = [("one_tok_s", prompts[:1]), ("four_tok_s", prompts)]
            for key, ps in order if r % 2 == 0 else order[::-1]:
                res[key].append(await aggregate_tok_s(two, ps, args.session_tokens))
        rtt = await ping_us(three)
        # prompts cut for the pipeline (chunks_of with its stages) vs cut as for one stage (the
        # largest chunk size only: pipeline_min_chunk at the largest size), on the same nodes
        one_cut = await cluster(m, [n.port for n in nodes[:3]], [(0, 9), (10, 19), (20, 29)],
                                RuntimeConfig(threads=1, pipeline_min_chunk=256))
        pre = await prefill_ms({"pipeline_cut": three, "one_stage_cut": one_cut}, prompt,
                               PREFILL_LENGTHS, args.prefill_rounds)
        await one_cut.close()
        await three.close()
        await two.close()
    finally:
        for n in nodes:
            n.kill()
    med = {k: statistics.median(v) for k, v in res.items()}
    paired = [p / q for p, q in zip(res["pipe3_ms"], res["local_ms"], strict=True)]
    paired2 = [p / q for p, q in zip(res["pipe2_ms"], res["local_ms"], strict=True)]
    conc = [f / o for f, o in zip(res["four_tok_s"], res["one_tok_s"], strict=True)]
    hops, hops2 = hop_summary(traces), hop_summary(traces2)
    return {
        "model": m.name, "export": args.export, "threads_per_node": 1, "decode_tokens_each": args.tokens,
        "block_tokens": args.block, "block_pairs": len(paired), "session_tokens": args.session_tokens,
        "single_process_decode_ms_per_token": round(statistics.fmean(res["local_ms"]), 2),
        "pipeline_2_nodes_decode_ms_per_token": round(statistics.fmean(res["pipe2_ms"]), 2),
        "pipeline_3_nodes_decode_ms_per_token": round(statistics.fmean(res["pipe3_ms"]), 2),
        # speed (tok/s) of each pipeline over the single process's, from total times over the
        # same tokens (the blocks are equal in size)
        "speed_2_nodes_vs_single": round(sum(res["local_ms"]) / sum(res["pipe2_ms"]), 3),
        "speed_3_nodes_vs_single": round(sum(res["local_ms"]) / sum(res["pipe3_ms"]), 3),
        "speed_2_nodes_vs_single_paired_median": round(statistics.median(1 / r for r in paired2), 3),
        # time ratios, 3 nodes (the figure of the earlier runs)
        "pipeline_vs_single_ratio": round(sum(res["pipe3_ms"]) / sum(res["local_ms"]), 3),
        "pipeline_vs_single_ratio_paired_median": round(statistics.median(paired), 3),
        "paired_ratio_quartiles": [round(q, 3) for q in statistics.quantiles(paired, n=4)],
        # per decode step, from the steps' traces: (client round trip - time held by stages) / 4
        "per_hop_overhead_us_median": round(hops["hop_us"], 1),
        "stage_handling_us_median": round(hops["stage_overhead_us"], 1),  # 3 stages, beyond ONNX
        "stages_compute_ms_median": round(hops["compute_us"] / 1e3, 2),
        "single_process_layers_ms_median": round(statistics.median(local_layers_ms), 2),
        "step_round_trip_ms_median": round(hops["rtt_us"] / 1e3, 2),  # client sends -> result in
        "two_nodes_per_hop_overhead_us_median": round(hops2["hop_us"], 1),
        "two_nodes_stage_handling_us_median": round(hops2["stage_overhead_us"], 1),  # 2 stages
        "per_hop_from_difference_us": round((statistics.fmean(res["pipe3_ms"])
                                             - statistics.fmean(res["local_ms"])) * 1e3 / 4, 1),
        "ping_rtt_us_median": round(rtt, 1),
        "two_nodes_one_session_tok_s": round(med["one_tok_s"], 2),
        "two_nodes_four_sessions_tok_s": round(med["four_tok_s"], 2),
        "four_vs_one_session_ratio": round(med["four_tok_s"] / med["one_tok_s"], 3),
        "four_vs_one_session_ratio_paired_median": round(statistics.median(conc), 3),
        "concurrency_rounds": args.rounds,
        "raw": {k: [round(x, 3) for x in v] for k, v in res.items()},
        # 3 nodes: a prompt's prefill (ms, medians), cut for the pipeline vs as for one stage
        "prefill_3_nodes_ms": {str(n): {k: round(statistics.median(v[n]), 1) for k, v in pre.items()}
                               for n in PREFILL_LENGTHS},
        "prefill_3_nodes_pipeline_vs_one_stage_cut": {
            str(n): round(statistics.median(pre["pipeline_cut"][n])
                          / statistics.median(pre["one_stage_cut"][n]), 3) for n in PREFILL_LENGTHS},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=384, help="decode tokens per backend, paired")
    ap.add_argument("--block", type=int, default=8, help="tokens per turn when pairing")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of 1 vs 4 sessions")
    ap.add_argument("--session-tokens", type=int, default=48,
                    help="decode tokens per session (pairs restart their sessions after this many)")
    ap.add_argument("--models", type=Path, default=Path("models/bench"))
    ap.add_argument("--export", choices=["int4-fast", "fp32"], default="int4-fast")
    ap.add_argument("--prefill-rounds", type=int, default=3, help="rounds of each prompt length")
    install_uvloop()  # the same event loop as `edgelite generate` and the nodes
    print(json.dumps(asyncio.run(main_async(ap.parse_args())), indent=1))


if __name__ == "__main__":
    main()
