"""edgelite's product operators (engine/kernels) against onnxruntime's MatMulNBits on the same
weights, 1 thread
(issue 35).

For each product (MatMul4: 4-bit codes in blocks of 32 with a float scale; MatMul4K: a Q4_K's
codes, scales and minima, against the export's form, MatMulNBits plus the float minima product
of x's block sums; MatMul6: a Q6_K's 6-bit codes with a float16 per 256 weights and a signed
byte per block of 16; MatMul8: 8-bit codes in blocks of 32, a Q8_0 product or an int4 export's
head) and each row count (1: a decode step; 17 and 64: prompt chunks; 2-5: a speculative
step's positions): COPIES random matrices of K x N (more
than the caches hold, so the weights come from memory, as a layer's do), run as one session
each way, in alternating order round by round. MatMulNBits gets the same values (the codes
widened to its storage, the scales as floats). Prints one JSON: microseconds a matrix, the
ratio, the bits each side holds a weight, and the GB/s edgelite's side reads them at beside the
machine's read bandwidth (numpy summing one large array, in the same run).

    python scripts/bench_matmul.py [--rounds 7] [--ops MatMul4,MatMul4K,MatMul6,MatMul8] [--rows 1,17,64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent))

SHAPES = ((2048, 8192), (4096, 4096), (8192, 2048))  # K x N: 1 B and 7 B layers' products
COPIES = 8  # matrices a run: 8 x 16.8 M weights, past the caches


def _models(op: str, k: int, n: int, rng: np.random.Generator) -> tuple[bytes, bytes, dict[str, float]]:
    """(edgelite's model, MatMulNBits' model, bits a weight each holds)."""
    from onnx import TensorProto, helper, numpy_helper

    from edgelite.engine import kernels
    from edgelite.engine.kernels import twins

    mine, theirs, inits_m, inits_t = [], [], [], []
    if op == "MatMul4K":  # (x's block sums, once for all copies, as the export shares them)
        inits_t.append(numpy_helper.from_array(np.array([0, k // 32, 32], np.int64), "blocks"))
        inits_t.append(numpy_helper.from_array(np.array([-1], np.int64), "last"))
        theirs += [helper.make_node("Reshape", ["x", "blocks"], ["xb"]),
                   helper.make_node("ReduceSum", ["xb", "last"], ["sums"], keepdims=0)]
    for i in range(COPIES):
        if op == "MatMul4":
            codes = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
            scales = (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float32)
            weights = dict(zip(("codes", "scales"), twins.interleaved(codes, scales), strict=True))
            theirs_in, bits, block = (codes, scales), 4, 32
            attrs = {}
        elif op == "MatMul8":
            codes = rng.integers(0, 256, (n, k // 32, 32), dtype=np.uint8)
            scales = (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float32)
            weights = dict(zip(("codes", "scales"), twins.interleaved8(codes, scales), strict=True))
            theirs_in, bits, block = (codes, scales), 8, 32
            attrs = {"zero": twins.ZERO8}
        elif op == "MatMul4K":
            codes = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
            sc, mins = (rng.integers(0, 64, (n, k // 32), dtype=np.uint8) for _ in range(2))
            d, e = ((rng.random((n, k // 256)) * 0.001).astype(np.float16) for _ in range(2))
            four_k = twins.interleaved4k(codes, sc, mins, d, -e)
            weights = dict(zip(("codes", "mult", "base"), four_k, strict=True))
            scales = (np.repeat(d.astype(np.float32), 8, axis=1) * sc).astype(np.float32)
            minima = (scales * 8 - np.repeat(e.astype(np.float32), 8, axis=1) * mins).astype(np.float32)
            theirs_in, bits, block = (codes, scales), 4, 32
            attrs = {}
            inits_t.append(numpy_helper.from_array(np.ascontiguousarray(minima.T), f"M{i}"))
            theirs += [helper.make_node("MatMul", ["sums", f"M{i}"], [f"low{i}"]),
                       helper.make_node("Add", [f"part{i}", f"low{i}"], [f"y{i}"])]
        else:
            codes = rng.integers(0, 64, (n, k), dtype=np.uint8)
            mult = rng.integers(-128, 128, (n, k // 16), dtype=np.int8)
            base = (rng.random((n, k // 256)) * 0.001).astype(np.float32)
            six = twins.interleaved6(codes, mult, base)
            weights = dict(zip(("codes", "mult", "base"), six, strict=True))
            scales = (np.repeat(base, 16, axis=1) * mult.astype(np.float32)).astype(np.float32)
            theirs_in, bits, block = ((codes + 128 - twins.ZERO6).reshape(n, k // 16, 16), scales), 8, 16
            attrs = {"zero": twins.ZERO6}
        names = [f"{w}{i}" for w in weights]
        inits_m += [numpy_helper.from_array(v, nm) for v, nm in zip(weights.values(), names, strict=True)]
        mine.append(helper.make_node(op, ["x", *names], [f"y{i}"], domain=kernels.DOMAIN, K=k, N=n, **attrs))
        inits_t += [numpy_helper.from_array(theirs_in[0], f"B{i}"),
                    numpy_helper.from_array(theirs_in[1], f"S{i}")]
        theirs.append(helper.make_node("MatMulNBits", ["x", f"B{i}", f"S{i}"],
                                       [f"part{i}" if op == "MatMul4K" else f"y{i}"],
                                       domain="com.microsoft", K=k, N=n, bits=bits, block_size=block,
                                       accuracy_level=4))
    held = {"edgelite": sum(t.ByteSize() for t in inits_m) * 8 / (COPIES * k * n),
            "matmulnbits": sum(t.ByteSize() for t in inits_t) * 8 / (COPIES * k * n)}

    def model(nodes: list, inits: list) -> bytes:
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["m", n])
                               for i in range(COPIES)], inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                helper.make_opsetid("com.microsoft", 1),
                                                helper.make_opsetid(kernels.DOMAIN, 1)])
        m.ir_version = 9
        return m.SerializeToString()

    return model(mine, inits_m), model(theirs, inits_t), held


def _bandwidth() -> float:
    """GB/s numpy reads one 512 MiB array at, summing it (best of 5)."""
    a = np.ones(2**27, np.float32)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def main() -> None:
    import onnxruntime as ort

    from edgelite.config import RuntimeConfig
    from edgelite.engine import kernels

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ops", default="MatMul4,MatMul4K,MatMul6,MatMul8",
                    help="which products (comma-separated)")
    ap.add_argument("--rows", default="1,17,64", help="rows a product (comma-separated)")
    args = ap.parse_args()
    library = kernels.library(RuntimeConfig(threads=1))
    kinds = kernels.matmul_kinds(library) if library is not None else frozenset()
    ops = [op for op in args.ops.split(",") if op in kinds]
    if not ops:
        raise SystemExit(f"the kernel library has no vector path here for {args.ops} "
                         "(MatMul4, MatMul8: AVX2; all four: AVX-512 VNNI and VBMI)")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.register_custom_ops_library(str(library))
    rng = np.random.default_rng(0)
    out: dict = {"copies": COPIES, "read_gb_s": round(_bandwidth(), 1), "products": {}}
    for op in ops:
        for k, n in SHAPES:
            mine, theirs, held = _models(op, k, n, rng)
            sessions = {"edgelite": ort.InferenceSession(mine, opts, providers=["CPUExecutionProvider"]),
                        "matmulnbits": ort.InferenceSession(theirs, opts, providers=["CPUExecutionProvider"])}
            for rows in [int(r) for r in args.rows.split(",")]:
                x = rng.standard_normal((rows, k)).astype(np.float32)
                got = {side: s.run(None, {"x": x})[0] for side, s in sessions.items()}
                diff = np.abs(got["edgelite"] - got["matmulnbits"]).max()
                rel = float(diff / np.abs(got["matmulnbits"]).max())
                times: dict[str, list[float]] = {side: [] for side in sessions}
                for r in range(args.rounds):
                    for side in (list(sessions) if r % 2 == 0 else list(sessions)[::-1]):
                        t = time.perf_counter()
                        sessions[side].run(None, {"x": x})
                        times[side].append((time.perf_counter() - t) / COPIES * 1e6)
                med = {side: statistics.median(v) for side, v in times.items()}
                out["products"][f"{op} {k}x{n} rows={rows}"] = {
                    "us_edgelite": round(med["edgelite"], 1), "us_matmulnbits": round(med["matmulnbits"], 1),
                    "speedup": round(med["matmulnbits"] / med["edgelite"], 3),
                    "edgelite_bits_per_weight": round(held["edgelite"], 2),
                    "matmulnbits_file_bits_per_weight": round(held["matmulnbits"], 2),
                    "edgelite_gb_s": round(held["edgelite"] * k * n / 8 / med["edgelite"] / 1e3, 1),
                    "max_rel_diff": rel}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
