"""Decode speed and memory against context length, SmolLM2-135M (int4 fast; fp32 for memory),
1 thread (issues 14 and 40).

- Attention alone, per layer, at 1,000 and 4,000 positions of context: one decode step through
  30 attention layers in one session run, as a range runs them (each layer its own KV, laid out
  as engine/kv.py's pool holds a session's, so each reads its KV from memory, not cache), for
  onnxruntime's GroupQueryAttention (what `--no-invariant` runs), engine/passes/attention.py's plain
  operators and edgelite's kernel (engine/kernels), with float32, float16 and (the kernel's) int8 KV.
  Each path's KV bytes read per second against the machine's read bandwidth, measured in the
  same run (numpy's sum over one 512 MiB array).
- Decode ms/token of the 30 layers at contexts 50, 1,000 and 4,000 (prompts of random hidden
  states), and the prefill of those prompts (256-token chunks), for the kernel with float16 KV
  (the int4 fast export's default), float32 and int8 KV, the fallbacks without a kernel (float32:
  GroupQueryAttention with one-row steps padded to two; float16: plain operators) and
  `--no-invariant` (GroupQueryAttention as it is), in alternating order round by round.
- Quality of float16 and int8 KV: mean KL divergence and top-1 agreement against float32 KV
  over the exporter's fixed text, and each one's KL divergence from the fp32 export (the
  reference).
- Memory: a node process serving all 30 layers, its RSS after loading, after a 2,000-token
  prompt and after the session ends, for each KV dtype; the same for the single process.

Prints one JSON.

    python scripts/bench_context.py [--models DIR] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_local import edgelite_export, rss_mib

CONTEXTS = (50, 1000, 4000)
ATTENTION_CONTEXTS = (1000, 4000)
CONFIGS = ("kernel-float32", "kernel-float16", "kernel-int8", "padded-float32", "plain-float16",
           "gqa-float32")
LAYERS = 30


def bandwidth() -> float:
    """GB/s numpy reads one large array at (its sum: one pass, one thread), best of 5."""
    a = np.ones(128 * 2**20, np.float32)  # 512 MiB
    best = min(_timed(a.sum) for _ in range(5))
    return a.nbytes / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _attention_model(heads: int, kv: int, d: int, rot: int, cap: int, layers: int) -> bytes:
    """`layers` GroupQueryAttention nodes as a range runs them: each layer's queries are the
    previous one's output, the new keys and values one input shared by all, each its own KV."""
    from onnx import TensorProto, helper

    f32 = TensorProto.FLOAT
    kv_shape = [1, kv, cap, d]
    inputs = [helper.make_tensor_value_info("hidden_0", f32, [1, "n", heads * d]),
              helper.make_tensor_value_info("k", f32, [1, "n", kv * d]),
              helper.make_tensor_value_info("v", f32, [1, "n", kv * d]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total_seq", TensorProto.INT32, []),
              helper.make_tensor_value_info("cos_cache", f32, [cap, rot // 2]),
              helper.make_tensor_value_info("sin_cache", f32, [cap, rot // 2])]
    outputs, nodes = [], []
    for i in range(layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_{kind}_{i}", f32, kv_shape))
            outputs.append(helper.make_tensor_value_info(f"present_{kind}_{i}", f32, kv_shape))
        nodes.append(helper.make_node(
            "GroupQueryAttention", [f"hidden_{i}", "k", "v", f"past_key_{i}", f"past_value_{i}", "seqlens_k",
                                    "total_seq", "cos_cache", "sin_cache"],
            [f"hidden_{i + 1}", f"present_key_{i}", f"present_value_{i}"], domain="com.microsoft",
            num_heads=heads, kv_num_heads=kv, scale=d ** -0.5, do_rotary=1))
    outputs.append(helper.make_tensor_value_info(f"hidden_{layers}", f32, [1, "n", heads * d]))
    graph = helper.make_graph(nodes, "attention", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    return model.SerializeToString()


def attention(model: Path, rounds: int, reps: int) -> dict:
    """Per-layer decode attention time of each path at each context (see the module's text)."""
    import onnxruntime as ort

    from edgelite import manifest as mf
    from edgelite.config import RuntimeConfig
    from edgelite.engine import kernels
    from edgelite.engine.kernels import twins
    from edgelite.engine.passes.attention import plain_attention
    from edgelite.manifest import KV_ITEM, kv_row_values

    m = mf.load(model)
    heads, kv, d, rot = m.num_heads, m.num_kv_heads, m.head_dim, m.rotary_dim
    cap = max(ATTENTION_CONTEXTS) + 64
    base = _attention_model(heads, kv, d, rot, cap, LAYERS)
    library = kernels.library(RuntimeConfig(threads=1))
    if library is None:
        raise SystemExit("no attention kernel could be built here (see the warning above)")
    graphs = {"gqa-float32": (base, np.float32), "plain-float32": (plain_attention(base, d, rot), np.float32),
              "plain-float16": (plain_attention(base, d, rot, "float16"), np.float16),
              "kernel-float32": (plain_attention(base, d, rot, "float32", True), np.float32),
              "kernel-float16": (plain_attention(base, d, rot, "float16", True), np.float16),
              "kernel-int8": (plain_attention(base, d, rot, "int8", True), np.int8)}
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.register_custom_ops_library(str(library))
    rng = np.random.default_rng(0)
    angles = np.outer(np.arange(cap), 1.0 / 10000 ** (np.arange(0, rot, 2) / rot))
    tables = {"cos_cache": np.cos(angles).astype(np.float32), "sin_cache": np.sin(angles).astype(np.float32)}
    feeds = {"hidden_0": rng.standard_normal((1, 1, heads * d)).astype(np.float32),
             "k": rng.standard_normal((1, 1, kv * d)).astype(np.float32),
             "v": rng.standard_normal((1, 1, kv * d)).astype(np.float32), **tables}
    times: dict[str, list[float]] = {}
    for ctx in ATTENTION_CONTEXTS:
        runs = {}  # path -> (session, binding, its buffers), all made before any is timed
        for name, (graph, dtype) in graphs.items():
            s = ort.InferenceSession(graph, opts, providers=["CPUExecutionProvider"])
            # the KV laid out as engine/kv.py's pool holds a session's (one mapping: each layer's
            # keys, then its values); an array a layer read up to 1.6x slower in this harness
            pool = twins.random_kv(rng, (LAYERS, 2, kv, cap, d), dtype)
            bufs = [pool[i, j][None] for i in range(LAYERS) for j in range(2)]
            out = np.zeros((1, 1, heads * d), np.float32)
            io = s.io_binding()
            step = {**feeds, "seqlens_k": np.array([ctx], np.int32), "total_seq": np.array(ctx + 1, np.int32)}
            for n, arr in step.items():
                io.bind_cpu_input(n, arr)
            for i in range(LAYERS):
                for j, kind in enumerate(("key", "value")):
                    arr = bufs[2 * i + j]
                    io.bind_input(f"past_{kind}_{i}", "cpu", 0, dtype, list(arr.shape), arr.ctypes.data)
                    io.bind_output(f"present_{kind}_{i}", "cpu", 0, dtype, list(arr.shape), arr.ctypes.data)
            io.bind_output(f"hidden_{LAYERS}", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
            s.run_with_iobinding(io)
            runs[name] = (s, io, bufs, out)
        for r in range(rounds):
            for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                s, io = runs[name][:2]
                for _ in range(reps):
                    t = time.perf_counter()
                    s.run_with_iobinding(io)
                    times.setdefault(f"{name}@{ctx}", []).append((time.perf_counter() - t) / LAYERS * 1e6)
        del runs
    gbs = bandwidth()
    out_: dict = {"numpy_read_gb_s": round(gbs, 2), "paths": {}}
    for key, ts in times.items():
        name, ctx = key.split("@")
        dtype = name.split("-")[1]
        read = 2 * kv * int(ctx) * kv_row_values(dtype, d) * KV_ITEM[dtype]  # what one layer's step reads
        us = statistics.median(ts)
        out_["paths"][key] = {"us_per_layer": round(us, 1), "kv_bytes": read,
                              "gb_s": round(read / us / 1e3, 2),
                              "of_bandwidth": round(read / us / 1e3 / gbs, 3)}
    return out_


def decode_ms(layers, context: int, steps: int, rng: np.random.Generator) -> tuple[float, float]:
    """(prefill ms of a `context`-token prompt, decode ms/token after it)."""
    h = layers.manifest.hidden_size
    prompt = rng.standard_normal((1, context, h)).astype(np.float32)
    token = rng.standard_normal((1, 1, h)).astype(np.float32)
    slot = layers.pool.acquire()
    t0 = time.perf_counter()
    for a in range(0, context, layers.max_chunk):
        layers.run(slot, prompt[:, a:a + layers.max_chunk])
    prefill = (time.perf_counter() - t0) * 1e3
    layers.run(slot, token)
    t0 = time.perf_counter()
    for _ in range(steps):
        layers.run(slot, token)
    ms = (time.perf_counter() - t0) / steps * 1e3
    layers.pool.release(slot)
    return prefill, ms


def runtime(config: str):
    from edgelite.config import RuntimeConfig

    path, dtype = config.split("-")
    return RuntimeConfig(threads=1, invariant=path != "gqa", kv_dtype=dtype,
                         attention_kernel=path == "kernel")


def speed(model: Path, rounds: int, steps: int) -> dict:
    from edgelite import manifest as mf
    from edgelite.engine.layers import LayerRange, export_files

    m = mf.load(model)
    ranges = {c: LayerRange(m, 0, m.num_layers - 1, runtime(c), export_files(m)) for c in CONFIGS}
    rng = np.random.default_rng(0)
    got: dict[str, list[float]] = {}
    pre: dict[str, list[float]] = {}
    for r in range(rounds):
        order = [(c, ctx) for ctx in CONTEXTS for c in CONFIGS]
        for c, ctx in order if r % 2 == 0 else order[::-1]:
            p, d = decode_ms(ranges[c], ctx, steps, rng)
            got.setdefault(f"{c}@{ctx}", []).append(d)
            pre.setdefault(f"{c}@{ctx}", []).append(p)
    med = {k: round(statistics.median(v), 3) for k, v in got.items()}
    return {"layers_decode_ms": med,
            "layers_prefill_ms": {k: round(statistics.median(v), 1) for k, v in pre.items()},
            "speed_vs_context_50": {c: {str(ctx): round(med[f"{c}@50"] / med[f"{c}@{ctx}"], 3)
                                        for ctx in CONTEXTS[1:]} for c in CONFIGS}}


def quality(fast: Path, reference: Path) -> dict:
    """float16 and int8 KV against float32 KV over the exporter's fixed text (see the module's
    text)."""
    from edgelite import manifest as mf
    from edgelite.config import RuntimeConfig
    from edgelite.engine.runtime import LocalChain
    from edgelite.reply.tokenizer import Tokenizer
    from edgelite_export.reference_text import TEXT

    def log_probs(path: Path, dtype: str) -> np.ndarray:
        chain = LocalChain(mf.load(path), RuntimeConfig(threads=2, kv_dtype=dtype))
        x = chain.logits_all("t", np.array([text])).astype(np.float64)
        x -= x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    text = Tokenizer(mf.load(fast)).encode(TEXT)
    ref = log_probs(reference, "float32")
    got = {dtype: log_probs(fast, dtype) for dtype in ("float32", "float16", "int8")}
    f32 = got["float32"]

    def kl(p: np.ndarray, q: np.ndarray) -> float:
        return float((np.exp(p) * (p - q)).sum(-1).mean())

    out: dict = {"positions": len(text),
                 "kl_from_fp32_export": {f"{d}_kv": kl(ref, x) for d, x in got.items()}}
    for dtype in ("float16", "int8"):
        x = got[dtype]
        out |= {f"kl_{dtype}_from_float32_kv": kl(f32, x),
                f"top1_{dtype}_vs_float32_kv": round(float((f32.argmax(-1) == x.argmax(-1)).mean()), 4),
                f"kl_increase_{dtype}": kl(ref, x) - kl(ref, f32)}
    return out


def local_memory(model: Path, dtype: str) -> dict:
    """RSS of a single process (this one is fresh: run as a child), its heap set up as the
    CLI sets it (edgelite/heap.py)."""
    from edgelite import heap
    from edgelite import manifest as mf
    from edgelite.config import RuntimeConfig
    from edgelite.engine.runtime import LocalChain

    heap.give_back_large_blocks()
    m = mf.load(model)
    chain = LocalChain(m, RuntimeConfig(threads=1, kv_dtype=dtype))
    loaded = rss_mib()
    chain.forward("s", np.random.default_rng(0).integers(0, 1000, (1, 2000)))
    after = rss_mib()
    capacity = chain.layers.pool.bucket_bytes(2000) / 2**20
    chain.end("s")
    return {"rss_loaded_mib": round(loaded, 1), "rss_after_2000_mib": round(after, 1),
            "rss_after_end_mib": round(rss_mib(), 1), "kv_capacity_mib": round(capacity, 1),
            "kv_bytes_per_token": chain.layers.pool.token_bytes}


def node_rss(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024


async def node_memory(model: Path, dtype: str) -> dict:
    from edgelite import manifest as mf
    from edgelite.cli.localnodes import TOKEN, start_node
    from edgelite.client.backend import open_backend
    from edgelite.config import RuntimeConfig
    from edgelite.ids import NodeAddr
    from edgelite.planner.solve import split_plan

    m = mf.load(model)
    home = Path(tempfile.mkdtemp())
    node = start_node(home / "n", threads=1, kv_budget_mb=1024,
                      extra=("--kv-dtype", dtype))
    try:
        plan = split_plan([(0, m.num_layers - 1)], [NodeAddr("127.0.0.1", node.port)], m.num_layers)
        be = await open_backend(m, plan, TOKEN, runtime=RuntimeConfig(threads=1))
        pid = node.proc.pid
        loaded = node_rss(pid)
        ids = np.random.default_rng(0).integers(0, 1000, (1, 2000))
        await be.forward("s", ids)
        after = node_rss(pid)
        await be.end("s")
        await asyncio.sleep(0.5)
        ended = node_rss(pid)
        await be.close()
    finally:
        node.kill()
        shutil.rmtree(home, ignore_errors=True)
    capacity = m.kv_bytes(0, m.num_layers - 1, 2048, dtype) / 2**20
    return {"rss_loaded_mib": round(loaded, 1), "rss_after_2000_mib": round(after, 1),
            "rss_after_end_mib": round(ended, 1), "kv_capacity_mib": round(capacity, 1),
            "within_bound": after <= loaded + capacity + 64 and ended <= loaded + 64}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--reps", type=int, default=5, help="attention timings per round")
    ap.add_argument("--models", type=Path, default=Path("models/bench"))
    ap.add_argument("--local-memory", nargs=2, help=argparse.SUPPRESS)  # child: a model, a dtype
    args = ap.parse_args()
    if args.local_memory:
        print(json.dumps(local_memory(Path(args.local_memory[0]), args.local_memory[1])))
        return
    fast = edgelite_export(args.models / "smol-int4-fast")
    reference = edgelite_export(args.models / "smol-fp32", "--quantize", "none")
    out: dict = {"attention": attention(fast, args.rounds, args.reps),
                 "decode": speed(fast, args.rounds, args.steps),
                 "kv_quality": quality(fast, reference), "memory": {}}
    for dtype in ("float32", "float16", "int8"):
        child = subprocess.run([sys.executable, __file__, "--local-memory", str(fast), dtype],
                               capture_output=True, text=True, check=True)
        local = json.loads(child.stdout.strip().splitlines()[-1])
        local["within_bound"] = (local["rss_after_2000_mib"] <= local["rss_loaded_mib"]
                                 + local["kv_capacity_mib"] + 64
                                 and local["rss_after_end_mib"] <= local["rss_loaded_mib"] + 64)
        out["memory"][dtype] = {"single_process": local, "node": asyncio.run(node_memory(fast, dtype))}
    print(json.dumps({"model": "SmolLM2-135M-Instruct int4 fast", "threads": 1, "contexts": CONTEXTS,
                      "results": out}, indent=1))


if __name__ == "__main__":
    main()
