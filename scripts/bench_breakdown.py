"""Where a split model's decode token goes, next to the bytes it reads and this machine's bandwidth.

    python scripts/bench_breakdown.py --model EXPORT [--nodes 4] [--node-mb 1536]
        [--client-mb 1024] [--tokens 32] [--context 2048] [--steps 24] [--positions 4000]

1. numpy's read bandwidth in this process, one thread: the sum of a 1 GiB float32 array, best
   of 5 (before the runs and after them).
2. The split run: `--nodes` node processes on loopback at `--node-mb`, planned over them as
   `edgelite generate` plans (probe + HiGHS, `--client-mb` for this process), `--tokens` greedy
   tokens of a raw prompt, 1 thread everywhere. Each decode step's trace gives, per token: the
   client's own part (its layers, the head, choosing the token: the token's time less the
   step's round trip), each node's compute, the time nodes held the step beyond computing
   (waiting: reading, queueing, writing) and the hops (the round trip less what the nodes held).
3. The largest node stage's layers loaded here as that node loads them (the same runtime
   settings), decode steps at the position the split run ended at, profiled by onnxruntime:
   ms a token in the products (MatMul*), attention (Attend*, GroupQueryAttention) and the other
   operators; the bytes a token reads there (the range's weight files and its KV so far) over
   its time: the bandwidth it reaches, beside numpy's. With `--positions N,...`, the same again
   after prompts of those lengths (what attention costs as the context grows).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent))

PROMPT = "The history of the city begins in the early years of the twelfth century, when a"


def numpy_read_gbs(gib: float = 1.0, rounds: int = 5) -> float:
    """GB/s of one thread summing a float32 array of `gib` GiB (read once a round)."""
    a = np.ones(int(gib * (1 << 30)) // 4, dtype=np.float32)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return round(a.nbytes / best / 1e9, 2)


async def split_run(model: Path, addrs: list[str], client_mb: float, tokens: int,
                    context: int) -> dict:
    import edgelite
    from edgelite.cli import options
    from edgelite.cli.localnodes import TOKEN
    from edgelite.cli.main import build_parser

    args = build_parser().parse_args([
        "generate", "--model", str(model), "--nodes", ",".join(addrs), "--token", TOKEN,
        "--threads", "1", "--no-spin", "--client-memory-mb", str(client_mb), "--kv-store-mb", "0",
        "--context", str(context), "--max-tokens", str(tokens), "--raw", PROMPT])
    kw = options.connect_kwargs(args)
    async with edgelite.connect(args.model, **kw) as llm:
        plan = llm.plan
        assert plan is not None and llm.cluster is not None
        times: list[float] = []
        reply = llm.complete(PROMPT, max_tokens=tokens)
        async for _ in reply:
            times.append(time.perf_counter())
        ids = reply.token_ids
        traces = [t for t in llm.cluster.traces if t.tokens == 1]
    gaps = np.diff(times) * 1e3
    token_ms = float(np.median(gaps))
    n_stages = len(traces[0].stages)
    rtt = statistics.median(t.rtt_us for t in traces) / 1e3
    held = [statistics.median(t.stages[i][1] for t in traces) / 1e3 for i in range(n_stages)]
    compute = [statistics.median(t.stages[i][0] for t in traces) / 1e3 for i in range(n_stages)]
    remote = plan.remote
    return {
        "plan": [(s.device, s.first, s.last) for s in plan.stages],
        "predicted_ms_per_token": round(plan.predicted.expected, 1) if plan.predicted else None,
        "tokens": len(ids), "decode_steps_traced": len(traces),
        "positions_at_end": len(reply.prompt) + len(ids),
        "ms_per_token": round(token_ms, 1),
        "client_own_ms": round(token_ms - rtt, 1),
        "nodes": [{"device": s.device, "layers": [s.first, s.last], "compute_ms": round(c, 1),
                   "predicted_compute_ms": round(s.compute_ms, 1), "waiting_ms": round(h - c, 2)}
                  for s, c, h in zip(remote, compute, held, strict=True)],
        "hops_ms": round(rtt - sum(held), 2), "hops": n_stages + 1,
    }


def profiled_range(model: Path, first: int, last: int, positions: int, steps: int,
                   workdir: Path) -> dict:
    """Decode steps of layers first-last at `positions` cached, onnxruntime's per-operator times."""
    from edgelite import manifest as mf
    from edgelite.config import RuntimeConfig
    from edgelite.engine.kv import KV_DTYPES
    from edgelite.engine.layers import LayerRange, export_files

    m = mf.load(model)
    cfg = RuntimeConfig(threads=1, allow_spinning=False, profile_prefix=str(workdir / "prof"))
    layers = LayerRange(m, first, last, cfg, export_files(m))
    rng = np.random.default_rng(0)
    h = m.hidden_size
    slot = layers.pool.acquire()
    prompt = rng.standard_normal((1, positions, h)).astype(np.float32)
    for a in range(0, positions, layers.max_chunk):
        layers.run(slot, prompt[:, a:a + layers.max_chunk])
    token = rng.standard_normal((1, 1, h)).astype(np.float32)
    t0 = time.perf_counter()
    for _ in range(steps):
        layers.run(slot, token)
    wall_ms = (time.perf_counter() - t0) / steps * 1e3
    by_op: dict[str, float] = defaultdict(float)
    for s in layers.sessions:  # (each session's last `steps` runs: the decode steps)
        events = json.loads(Path(s.end_profiling()).read_text())
        runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
        windows = [(e["ts"], e["ts"] + e["dur"]) for e in runs[-steps:]]
        for ev in events:
            if ev.get("cat") == "Node" and ev.get("name", "").endswith("_kernel_time") and any(
                    a <= ev["ts"] <= b for a, b in windows):
                by_op[ev["args"]["op_name"]] += ev["dur"] / 1e3 / steps
    kinds = {"products": 0.0, "attention": 0.0, "other": 0.0}
    for op, ms in by_op.items():
        kind = ("products" if op.startswith("MatMul") else
                "attention" if op.startswith("Attend") or op == "GroupQueryAttention" else "other")
        kinds[kind] += ms
    weights = sum(e.bytes + sum(d.bytes for d in e.data) for e in m.layers[first:last + 1])
    kv_bytes = (last - first + 1) * 2 * positions * m.num_kv_heads * layers.row * \
        np.dtype(KV_DTYPES[layers.kv_dtype]).itemsize
    layers.pool.release(slot)
    layers.close()
    read = weights + kv_bytes
    return {"layers": [first, last], "positions": positions, "steps": steps,
            "ms_per_token": round(wall_ms, 2),
            "by_kind_ms": {k: round(v, 2) for k, v in kinds.items()},
            "outside_operators_ms": round(wall_ms - sum(kinds.values()), 2),
            "by_operator_ms": {k: round(v, 3) for k, v in sorted(by_op.items(), key=lambda x: -x[1])},
            "weight_bytes": weights, "kv_bytes": int(kv_bytes),
            "read_gbs": round(read / (wall_ms / 1e3) / 1e9, 2),
            "products_read_gbs": round(weights / (kinds["products"] / 1e3) / 1e9, 2)
            if kinds["products"] else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--node-mb", type=float, default=1536)
    ap.add_argument("--client-mb", type=float, default=1024)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--positions", default="", help="comma-separated context lengths to profile at too")
    args = ap.parse_args()
    from edgelite.cli.localnodes import start_node

    out: dict = {"model": str(args.model), "numpy_read_gbs_before": numpy_read_gbs()}
    homes = [Path(tempfile.mkdtemp()) for _ in range(args.nodes)]
    nodes = [start_node(home, threads=1, memory_mb=args.node_mb, extra=("--no-spin", "--discovery-port", "0"))
             for home in homes]
    try:
        out["split"] = asyncio.run(split_run(args.model, [x.addr for x in nodes], args.client_mb,
                                             args.tokens, args.context))
    finally:
        for x in nodes:
            x.kill()
        for home in homes:
            shutil.rmtree(home, ignore_errors=True)
    busiest = max(out["split"]["nodes"], key=lambda n: n["compute_ms"])
    with tempfile.TemporaryDirectory() as tmp:
        out["one_node"] = profiled_range(args.model, *busiest["layers"],
                                         out["split"]["positions_at_end"], args.steps, Path(tmp))
    out["one_node"]["device_in_split"] = busiest["device"]
    for n in (int(x) for x in args.positions.split(",") if x):
        with tempfile.TemporaryDirectory() as tmp:
            out.setdefault("one_node_at", []).append(
                profiled_range(args.model, *busiest["layers"], n, args.steps, Path(tmp)))
    out["numpy_read_gbs_after"] = numpy_read_gbs()
    bw = max(out["numpy_read_gbs_before"], out["numpy_read_gbs_after"])
    for one in (out["one_node"], *out.get("one_node_at", [])):
        one["of_numpy_bandwidth"] = round(one["read_gbs"] / bw, 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
