"""A built library's check, run in a child process (`python -m edgelite.engine.kernels.check
LIBRARY --threads N`, build.checked): onnxruntime loads it and each operator gives what its
numpy twin gives (each KV dtype, a windowed layer, a chunk of rows; each product kind, rows in a
tile and one more; the norms). Exit status 0 when it passes; else one line saying what differs. A crash
here (a path this CPU cannot run) kills this process only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from edgelite.config import RuntimeConfig
from edgelite.engine import session
from edgelite.engine.kernels import twins
from edgelite.engine.kernels.models import attend_model, matmul_model, norm_model


def check(library: Path, cfg: RuntimeConfig) -> str | None:
    """None when onnxruntime loads `library` and its operators give what numpy gives; else what
    went wrong, in one line. (In this process: build.checked runs it in a child.)"""
    import onnxruntime as ort

    heads, kv, cap = 4, 2, 24
    rng = np.random.default_rng(0)
    try:
        opts = session.options(cfg, Path("."))  # (the process's thread pool, if it has one)
        opts.register_custom_ops_library(str(library))
        # (int8 twice: head sizes in multiples of 64 take its vector path where it has one)
        for dtype, op, d in (
            (np.float32, "Attend", 16),
            (np.float16, "Attend16", 16),
            (np.int8, "Attend8", 16),
            (np.int8, "Attend8", 64),
        ):
            error = _check_attend(ort, opts, rng, dtype, op, heads, kv, d, cap)
            if error:
                return error
        # MatMul4: 3 blocks (padded to 4) and 8; MatMul6, MatMul4K: 1 and 2 super-blocks; MatMul8:
        # 1 and 3 units of 64; rows in a tile of 4 and one more
        for op, k, n in (
            ("MatMul4", 96, 8),
            ("MatMul4", 256, 12),
            ("MatMul6", 256, 8),
            ("MatMul6", 512, 4),
            ("MatMul4K", 256, 8),
            ("MatMul4K", 512, 4),
            ("MatMul8", 64, 8),
            ("MatMul8", 192, 12),
        ):
            run = ort.InferenceSession(matmul_model(op, k, n), opts, providers=["CPUExecutionProvider"]).run
            a = rng.standard_normal((5, k)).astype(np.float32)
            feeds, want = product_case(rng, op, k, n, a)
            got = run(None, {"a": a, **feeds})[0]
            tolerance = 1e-4 * float(np.abs(want).max())
            if got.shape != want.shape or not np.allclose(got, want, rtol=1e-4, atol=tolerance):
                return f"its {op} differs from numpy's product (at most {np.abs(got - want).max():.2g})"
        for skip in (False, True):
            model = norm_model(skip, 64, 1e-5)
            run = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"]).run
            x, s = (rng.standard_normal((3, 64)).astype(np.float32) for _ in range(2))
            g = rng.uniform(0.5, 1.5, 64).astype(np.float32)
            got = run(None, {"x": x, "g": g, **({"skip": s} if skip else {})})
            want = twins.norm(x, g, 1e-5, s if skip else None)
            if not np.allclose(got[0], want, rtol=1e-5, atol=1e-5) or (
                    skip and not np.array_equal(got[1], x + s)):
                return f"its {'Skip' * skip}Norm differs from numpy's"
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
        first = str(exc).splitlines()[0] if str(exc) else repr(exc)
        return f"onnxruntime {ort.__version__} cannot run it: {first}"
    return None


def product_case(
    rng: np.random.Generator, op: str, k: int, n: int, a: np.ndarray
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Random weights of a product, laid out as the operator takes them, and its twin's result."""
    if op == "MatMul4":
        codes = rng.integers(0, 256, (n, -(-k // 32), 16), dtype=np.uint8)
        scales = rng.uniform(-1, 1, (n, -(-k // 32))).astype(np.float32)
        c4, s4 = twins.interleaved(codes, scales)
        return {"codes": c4, "scales": s4}, twins.matmul4(a, codes, scales)
    if op == "MatMul8":
        codes = rng.integers(0, 256, (n, k // 32, 32), dtype=np.uint8)
        scales = rng.uniform(-1, 1, (n, k // 32)).astype(np.float32)
        c8, s8 = twins.interleaved8(codes, scales)
        return {"codes": c8, "scales": s8}, twins.matmul8(a, codes, scales, twins.ZERO8)
    if op == "MatMul4K":
        codes = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
        sc, mins = (rng.integers(0, 64, (n, k // 32), dtype=np.uint8) for _ in range(2))
        d, e = (rng.uniform(-0.01, 0.01, (n, k // 256)).astype(np.float16) for _ in range(2))
        c4, mk, bk = twins.interleaved4k(codes, sc, mins, d, e)
        return {"codes": c4, "mult": mk, "base": bk}, twins.matmul4k(a, codes, sc, mins, d, e)
    codes = rng.integers(0, 64, (n, k), dtype=np.uint8)
    mult = rng.integers(-128, 128, (n, k // 16), dtype=np.int8)
    base = rng.uniform(-0.01, 0.01, (n, k // 256)).astype(np.float32)
    c6, m6, b6 = twins.interleaved6(codes, mult, base)
    return {"codes": c6, "mult": m6, "base": b6}, twins.matmul6(a, codes, mult, base, twins.ZERO6)


def _check_attend(
    ort, opts, rng: np.random.Generator, dtype: type, op: str, heads: int, kv: int, d: int, cap: int
) -> str | None:
    """None when the library's `op` gives numpy's attention over a step of 3 rows (a window of 5)
    and writes the step's rows into the KV as numpy rounds them; else what differs."""
    n, total, half = 3, 13, d // 4  # (the rotary tables turn half of each head: rot = d / 2)
    run = ort.InferenceSession(
        attend_model(op, heads, kv, d, cap, 5), opts, providers=["CPUExecutionProvider"]
    ).run
    q = rng.standard_normal((1, n, heads * d)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((1, n, kv * d)).astype(np.float32) for _ in range(2))
    k, v = (twins.random_kv(rng, (1, kv, cap, d), dtype) for _ in range(2))
    angles = np.outer(np.arange(cap), 1.0 / 10000 ** (np.arange(half) / half)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    pos = np.arange(total - n, total)
    others = np.ones(cap, bool)
    others[pos] = False
    # values float16 rounds with care (ties to even, up and down; subnormals; beyond its range),
    # a row of zeros and rows of 1e-13 and 1e13 (int8's steps) in a step of their own
    hard = v_new.copy()
    hard[0, 0, : len(twins.NARROW_CASES)] = twins.NARROW_CASES
    hard[0, 1, :d] = 0.0
    hard[0, 2, :d] *= 1e-13
    hard[0, 2, d : 2 * d] *= 1e13
    for new in (hard, v_new):
        feeds = {
            "q": q,
            "k_new": k_new,
            "v_new": new,
            "k": k,
            "v": v,
            "total": np.array([total], np.int64),
            "cos": cos,
            "sin": sin,
        }
        out, k_got, v_got = run(None, feeds)
        want_v = v.copy()
        rows = new.reshape(n, kv, d)
        with np.errstate(over="ignore"):  # (65520 and beyond: float16's infinity)
            want_v[0, :, pos] = {"float32": rows, "float16": rows.astype(np.float16)}.get(
                np.dtype(dtype).name, twins.quantized(rows)
            )
        if not np.array_equal(v_got, want_v) or not np.array_equal(k_got[0, :, others], k[0, :, others]):
            return f"its {op} writes other KV rows than numpy's"
    turned_k = twins.turned(k_new.reshape(n, kv, d), cos[pos], sin[pos])
    step = np.abs(turned_k).max() / 100 if dtype == np.int8 else 1e-2 if dtype == np.float16 else 1e-5
    if not np.allclose(twins.values(k_got)[0, :, pos], turned_k, atol=step):
        return f"its {op} turns the step's keys otherwise than numpy"
    turned_q = twins.turned(q.reshape(n, heads, d), cos[pos], sin[pos]).reshape(1, n, heads * d)
    want = twins.reference(turned_q, twins.values(k_got), twins.values(v_got), total, heads, 5)
    # (int8: queries and softmax weights as 8-bit codes; a broken build is off by it all)
    tolerance = 1e-4 if dtype != np.int8 else twins.INT8_TOLERANCE * float(np.abs(twins.values(v_got)).max())
    if out.shape != want.shape or not np.allclose(out, want, atol=tolerance):
        return f"its {op} differs from numpy's attention (at most {np.abs(out - want).max():.2g})"
    return None


def main(argv: list[str]) -> int:
    """python -m edgelite.engine.kernels.check LIBRARY [--threads N]"""
    if len(argv) not in (1, 3) or (len(argv) == 3 and (argv[1] != "--threads" or not argv[2].isdigit())):
        sys.stdout.write("usage: python -m edgelite.engine.kernels.check LIBRARY [--threads N]\n")
        return 2
    error = check(Path(argv[0]), RuntimeConfig(threads=int(argv[2]) if len(argv) == 3 else 1))
    if error:
        sys.stdout.write(error + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
