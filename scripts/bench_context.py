"""Decode speed and memory against context length: the in-place KV engine beside a dynamic
cache, SmolLM2-135M fp32 and int4 (fast), 1 thread.

- "static": edgelite's engine (preallocated KV slots bound in place; attention reads the real
  length).
- "dynamic": the same layer graphs with the KV passed in and returned as new tensors every step
  (what a concatenating cache does: each token copies the whole cache of every layer).
Decode ms/token is timed at contexts 50, 500, 1000 and 2000 (prompts of random tokens, in
alternating order). Memory: a node process serving all 30 layers, its RSS after loading, after a
2,000-token prompt and after the session ends; the same for the single process. Prints one JSON.

    python scripts/bench_context.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_local import edgelite_export, rss_mib

CONTEXTS = (50, 500, 1000, 2000)


class DynamicCache:
    """The layer graphs run with a new, concatenated KV every step (the old engine's cost)."""

    def __init__(self, layers) -> None:  # layers: edgelite.engine.layers.LayerRange
        self.r = layers
        m = layers.manifest
        self.kv = {j: [np.zeros((1, m.num_kv_heads, 0, m.head_dim), np.float32)] * 2
                   for j in range(layers.first, layers.last + 1)}

    def step(self, hidden: np.ndarray) -> np.ndarray:
        r, n = self.r, hidden.shape[1]
        past = next(iter(self.kv.values()))[0].shape[2]
        common = {"seqlens_k": np.array([past + n - 1], np.int32),
                  "total_seq": np.array(past + n, np.int32), **r.ropes}
        for session, (lo, hi) in zip(r.sessions, r.groups, strict=True):
            wants = {i.name for i in session.get_inputs()}
            feed = {k: v for k, v in common.items() if k in wants} | {f"hidden_{lo}": hidden}
            for j in range(lo, hi + 1):
                feed[f"past_key_{j}"], feed[f"past_value_{j}"] = self.kv[j]
            names = [f"hidden_{hi + 1}"] + [f"present_{x}_{j}" for j in range(lo, hi + 1)
                                            for x in ("key", "value")]
            out = session.run(names, feed)
            for i, j in enumerate(range(lo, hi + 1)):
                self.kv[j] = [out[1 + 2 * i], out[2 + 2 * i]]
            hidden = out[0]
        return hidden


def decode_ms(layers, kind: str, context: int, steps: int, rng: np.random.Generator) -> float:
    h = layers.manifest.hidden_size
    prompt = rng.standard_normal((1, context, h)).astype(np.float32)
    token = rng.standard_normal((1, 1, h)).astype(np.float32)
    if kind == "static":
        slot = layers.pool.acquire()
        for a in range(0, context, layers.max_chunk):
            layers.step(slot, prompt[:, a:a + layers.max_chunk])
        run = lambda: layers.step(slot, token)  # noqa: E731
    else:
        cache = DynamicCache(layers)
        for a in range(0, context, layers.max_chunk):
            cache.step(prompt[:, a:a + layers.max_chunk])
        run = lambda: cache.step(token)  # noqa: E731
    run()
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    ms = (time.perf_counter() - t0) / steps * 1e3
    if kind == "static":
        layers.pool.release(slot)
    return ms


def speed(model: Path, rounds: int, steps: int) -> dict:
    from edgelite import manifest as mf
    from edgelite.config import RuntimeConfig
    from edgelite.engine.layers import LayerRange, export_files

    m = mf.load(model)
    layers = LayerRange(m, 0, m.num_layers - 1, RuntimeConfig(threads=1), export_files(m))
    rng = np.random.default_rng(0)
    got: dict[str, list[float]] = {}
    for r in range(rounds):
        order = [(k, c) for c in CONTEXTS for k in ("static", "dynamic")]
        for kind, ctx in order if r % 2 == 0 else order[::-1]:
            got.setdefault(f"{kind}@{ctx}", []).append(decode_ms(layers, kind, ctx, steps, rng))
    med = {k: round(statistics.median(v), 3) for k, v in got.items()}
    return {"layers_decode_ms": med,
            "static_1000_vs_50_speed": round(med["static@50"] / med["static@1000"], 3),
            "static_vs_dynamic_speed_at_2000": round(med["dynamic@2000"] / med["static@2000"], 3)}


def local_memory(model: Path) -> dict:
    """RSS of a single process (this one is fresh: run as a child)."""
    from edgelite import manifest as mf
    from edgelite.config import RuntimeConfig
    from edgelite.engine.runtime import LocalChain

    m = mf.load(model)
    chain = LocalChain(m, RuntimeConfig(threads=1))
    loaded = rss_mib()
    chain.forward("s", np.random.default_rng(0).integers(0, 1000, (1, 2000)))
    after = rss_mib()
    capacity = chain.layers.pool.bucket_bytes(2000) / 2**20
    chain.end("s")
    return {"rss_loaded_mib": round(loaded, 1), "rss_after_2000_mib": round(after, 1),
            "rss_after_end_mib": round(rss_mib(), 1), "kv_capacity_mib": round(capacity, 1)}


def node_rss(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024


async def node_memory(model: Path) -> dict:
    from edgelite import manifest as mf
    from edgelite.cli.localnodes import TOKEN, start_node
    from edgelite.client.backend import open_backend
    from edgelite.config import RuntimeConfig
    from edgelite.ids import NodeAddr
    from edgelite.planner.solve import split_plan

    m = mf.load(model)
    node = start_node(Path(tempfile.mkdtemp()) / "n", threads=1, kv_budget_mb=1024)
    try:
        plan = split_plan([(0, m.num_layers - 1)], [NodeAddr("127.0.0.1", node.port)], m.num_layers)
        be = await open_backend(m, plan, TOKEN, runtime=RuntimeConfig(threads=1))
        pid = node.proc.pid
        loaded = node_rss(pid)
        ids = np.random.default_rng(0).integers(0, 1000, (1, 2000))
        await be.step("s", ids)
        after = node_rss(pid)
        await be.end("s")
        await asyncio.sleep(0.5)
        ended = node_rss(pid)
        await be.close()
    finally:
        node.kill()
    capacity = 2048 * m.kv_bytes_per_token(0, m.num_layers - 1) / 2**20
    return {"rss_loaded_mib": round(loaded, 1), "rss_after_2000_mib": round(after, 1),
            "rss_after_end_mib": round(ended, 1), "kv_capacity_mib": round(capacity, 1),
            "within_bound": after <= loaded + capacity + 64 and ended <= loaded + 64}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--models", type=Path, default=Path("models/bench"))
    ap.add_argument("--local-memory", help=argparse.SUPPRESS)  # child: a model folder
    args = ap.parse_args()
    if args.local_memory:
        print(json.dumps(local_memory(Path(args.local_memory))))
        return
    out = {}
    for name, flags in (("fp32", ("--quantize", "none")), ("int4_fast", ())):
        model = edgelite_export(args.models / f"smol-{name.replace('_', '-')}", *flags)
        child = subprocess.run([sys.executable, __file__, "--local-memory", str(model)],
                               capture_output=True, text=True, check=True)
        local = json.loads(child.stdout.strip().splitlines()[-1])
        local["within_bound"] = (local["rss_after_2000_mib"] <= local["rss_loaded_mib"]
                                 + local["kv_capacity_mib"] + 64
                                 and local["rss_after_end_mib"] <= local["rss_loaded_mib"] + 64)
        out[name] = {**speed(model, args.rounds, args.steps), "single_process_memory": local,
                     "node_memory": asyncio.run(node_memory(model))}
    print(json.dumps({"model": "SmolLM2-135M-Instruct", "threads": 1, "contexts": CONTEXTS,
                      "results": out}, indent=1))


if __name__ == "__main__":
    main()
