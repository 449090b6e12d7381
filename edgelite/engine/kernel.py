"""edgelite's operators, built for this device the first time a range needs them and kept in
the machine's build cache (`paths.cache()`/kernels), one library per source, compiler and
machine, each checked against numpy before use (a broken one is built again): engine/attend.c,
the attention operators, and engine/matmul.c, the products with narrow weights (engine/linear.py).

It is compiled here rather than shipped: phones have no wheel of ours to carry one, Termux has
clang (`pkg install clang`), and `-march=native` then fits the very core that runs it. Where
no C compiler works, or onnxruntime refuses the library, attention falls back to onnxruntime's
operators (engine/attention.py, engine/invariant.py), slower at long contexts, and says so once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from edgelite import paths
from edgelite.config import RuntimeConfig
from edgelite.engine import session
from edgelite.engine.onnxgraph import (
    FLOAT,
    FLOAT16,
    GRAPH_INPUT,
    GRAPH_NAME,
    GRAPH_NODE,
    GRAPH_OUTPUT,
    INT8,
    INT64,
    MODEL_GRAPH,
    MODEL_IR_VERSION,
    UINT8,
    encode,
    make_node,
    make_value_info,
    with_opset,
)

log = logging.getLogger(__name__)
DOMAIN = "edgelite"  # the operators' ONNX domain (attend.c registers it)
SOURCE = Path(__file__).with_name("attend.c")
SOURCES = (SOURCE, Path(__file__).with_name("matmul.c"))  # compiled together
HEADERS = (Path(__file__).with_name("ortop.h"),)
HEAD_DIMS = range(8, 257, 8)  # the head sizes attend.c computes (multiples of its 8 lanes, up to 256)
COMPILERS = ("cc", "clang", "gcc")  # tried in this order after $CC
# every build: optimised, no fast-math (no reassociation: a row's sums are the same sequence
# of roundings in every step; products and sums may fuse, the same way in every step: one
# build computes every row), position-independent for dlopen
FLAGS = ("-O3", "-shared", "-fPIC", "-pthread")
NATIVE = ("-march=native", "-mcpu=native")  # the first the compiler takes, if any
# Attend8 against numpy, of the values' largest magnitude (8-bit queries and weights: random
# rows, whose softmax is near one-hot, move by up to 3 %)
INT8_TOLERANCE = 5e-2
ZERO6 = 32  # the zero point of a Q6_K's codes (0..63), MatMul6's default
ZERO8 = 128  # MatMulNBits' zero point of 8-bit codes without zero points (MatMul8's attribute)
QUANT_SMALLEST = 1e-30  # attend.c's int8 KV rows: a row of zeros still gets a step (its codes are 0)
# (1 + 2^-11 and 1 + 3 2^-11: ties, to even down and up; 2^-25 and 3 2^-25: subnormal ties;
# 65519 and 65520: the largest float16, infinity)
NARROW_CASES = np.array([1 + 2**-11, 1 + 3 * 2**-11, -(2**-25), 3 * 2**-25, 1e-6, 65519.0, 65520.0, -7e4,
                         -0.0, 2**-14 - 2**-25], np.float32)
_lock = threading.Lock()
_built: list[Path | None] = []  # once looked for: the library, or None when none could be built


def library(cfg: RuntimeConfig) -> Path | None:
    """The built library, built now if this device has none yet; None (logged once) when it
    cannot be built."""
    with _lock:
        if not _built:
            _built.append(_build(cfg))
        return _built[0]


def _compilers() -> list[str]:
    names = [os.environ["CC"]] if os.environ.get("CC") else []
    return [p for p in (shutil.which(n) for n in (*names, *COMPILERS)) if p]


def _build(cfg: RuntimeConfig) -> Path | None:
    try:
        source = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    except OSError as exc:
        log.warning("attention kernel: cannot read %s (%s); using onnxruntime's operators", SOURCE, exc)
        return None
    compilers = _compilers()
    if not compilers:
        log.warning("attention kernel: no C compiler (cc, clang, gcc; Termux: pkg install clang); "
                    "using onnxruntime's operators, slower at long contexts")
        return None
    folder = paths.cache() / "kernels"
    errors = []
    for cc in compilers:
        tag = hashlib.sha256(source + cc.encode() + platform.machine().encode() + " ".join(FLAGS).encode())
        target = folder / f"attend-{tag.hexdigest()[:16]}.so"
        if target.is_file():
            error = check(target, cfg)
            if error is None:
                return target
            errors.append(error)
        for native in (*NATIVE, None):
            error = _compile(cc, native, target, cfg.kernel_build_s) or check(target, cfg)
            if error is None:
                log.info("attention kernel built: %s (%s %s)", target, Path(cc).name, native or "")
                return target
            target.unlink(missing_ok=True)
            errors.append(error)
    log.warning("attention kernel: %s; using onnxruntime's operators, slower at long contexts", errors[-1])
    return None


def check(library: Path, cfg: RuntimeConfig) -> str | None:
    """None when onnxruntime loads `library` and its operator gives what plain numpy gives
    (each KV dtype, a windowed layer, a chunk of rows); else what went wrong, in one line."""
    import onnxruntime as ort

    heads, kv, cap = 4, 2, 24
    rng = np.random.default_rng(0)
    try:
        opts = session.options(cfg, Path("."))  # (the process's thread pool, if it has one)
        opts.register_custom_ops_library(str(library))
        # (int8 twice: head sizes in multiples of 64 take its vector path where it has one)
        for dtype, op, d in ((np.float32, "Attend", 16), (np.float16, "Attend16", 16),
                             (np.int8, "Attend8", 16), (np.int8, "Attend8", 64)):
            error = _check_attend(ort, opts, rng, dtype, op, heads, kv, d, cap)
            if error:
                return error
        # MatMul4: 3 blocks (padded to 4) and 8; MatMul6, MatMul4K: 1 and 2 super-blocks; MatMul8:
        # 1 and 3 units of 64; rows in a tile of 4 and one more
        for op, k, n in (("MatMul4", 96, 8), ("MatMul4", 256, 12), ("MatMul6", 256, 8), ("MatMul6", 512, 4),
                         ("MatMul4K", 256, 8), ("MatMul4K", 512, 4), ("MatMul8", 64, 8),
                         ("MatMul8", 192, 12)):
            run = ort.InferenceSession(_matmul_model(op, k, n), opts, providers=["CPUExecutionProvider"]).run
            a = rng.standard_normal((5, k)).astype(np.float32)
            if op == "MatMul4":
                codes = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
                scales = rng.uniform(-1, 1, (n, k // 32)).astype(np.float32)
                c4, s4 = interleaved(codes, scales)
                got = run(None, {"a": a, "codes": c4, "scales": s4})[0]
                want = matmul4(a, codes, scales)
            elif op == "MatMul8":
                codes = rng.integers(0, 256, (n, k // 32, 32), dtype=np.uint8)
                scales = rng.uniform(-1, 1, (n, k // 32)).astype(np.float32)
                c8, s8 = interleaved8(codes, scales)
                got = run(None, {"a": a, "codes": c8, "scales": s8})[0]
                want = matmul8(a, codes, scales, ZERO8)
            elif op == "MatMul4K":
                codes = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
                sc, mins = (rng.integers(0, 64, (n, k // 32), dtype=np.uint8) for _ in range(2))
                d, e = (rng.uniform(-0.01, 0.01, (n, k // 256)).astype(np.float16) for _ in range(2))
                c4, mk, bk = interleaved4k(codes, sc, mins, d, e)
                got = run(None, {"a": a, "codes": c4, "mult": mk, "base": bk})[0]
                want = matmul4k(a, codes, sc, mins, d, e)
            else:
                codes = rng.integers(0, 64, (n, k), dtype=np.uint8)
                mult = rng.integers(-128, 128, (n, k // 16), dtype=np.int8)
                base = rng.uniform(-0.01, 0.01, (n, k // 256)).astype(np.float32)
                c6, m6, b6 = interleaved6(codes, mult, base)
                got = run(None, {"a": a, "codes": c6, "mult": m6, "base": b6})[0]
                want = matmul6(a, codes, mult, base, ZERO6)
            tolerance = 1e-4 * float(np.abs(want).max())
            if got.shape != want.shape or not np.allclose(got, want, rtol=1e-4, atol=tolerance):
                return f"its {op} differs from numpy's product (at most {np.abs(got - want).max():.2g})"
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
        first = str(exc).splitlines()[0] if str(exc) else repr(exc)
        return f"onnxruntime {ort.__version__} cannot run it: {first}"
    return None


def _check_attend(ort, opts, rng: np.random.Generator, dtype: type, op: str, heads: int, kv: int, d: int,
                  cap: int) -> str | None:
    """None when attend.c's `op` gives numpy's attention over a step of 3 rows (a window of 5)
    and writes the step's rows into the KV as numpy rounds them; else what differs."""
    n, total, half = 3, 13, d // 4  # (the rotary tables turn half of each head: rot = d / 2)
    run = ort.InferenceSession(_model(op, heads, kv, d, cap, 5), opts, providers=["CPUExecutionProvider"]).run
    q = rng.standard_normal((1, n, heads * d)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((1, n, kv * d)).astype(np.float32) for _ in range(2))
    k, v = (random_kv(rng, (1, kv, cap, d), dtype) for _ in range(2))
    angles = np.outer(np.arange(cap), 1.0 / 10000 ** (np.arange(half) / half)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    pos = np.arange(total - n, total)
    others = np.ones(cap, bool)
    others[pos] = False
    # values float16 rounds with care (ties to even, up and down; subnormals; beyond its range),
    # a row of zeros and rows of 1e-13 and 1e13 (int8's steps) in a step of their own
    hard = v_new.copy()
    hard[0, 0, :len(NARROW_CASES)] = NARROW_CASES
    hard[0, 1, :d] = 0.0
    hard[0, 2, :d] *= 1e-13
    hard[0, 2, d:2 * d] *= 1e13
    for new in (hard, v_new):
        feeds = {"q": q, "k_new": k_new, "v_new": new, "k": k, "v": v, "total": np.array([total], np.int64),
                 "cos": cos, "sin": sin}
        out, k_got, v_got = run(None, feeds)
        want_v = v.copy()
        rows = new.reshape(n, kv, d)
        with np.errstate(over="ignore"):  # (65520 and beyond: float16's infinity)
            want_v[0, :, pos] = {"float32": rows, "float16": rows.astype(np.float16)}.get(
                np.dtype(dtype).name, quantized(rows))
        if not np.array_equal(v_got, want_v) or not np.array_equal(k_got[0, :, others], k[0, :, others]):
            return f"its {op} writes other KV rows than numpy's"
    turned_k = _turned(k_new.reshape(n, kv, d), cos[pos], sin[pos])
    step = np.abs(turned_k).max() / 100 if dtype == np.int8 else 1e-2 if dtype == np.float16 else 1e-5
    if not np.allclose(_values(k_got)[0, :, pos], turned_k, atol=step):
        return f"its {op} turns the step's keys otherwise than numpy"
    turned_q = _turned(q.reshape(n, heads, d), cos[pos], sin[pos]).reshape(1, n, heads * d)
    want = _reference(turned_q, _values(k_got), _values(v_got), total, heads, 5)
    # (int8: queries and softmax weights as 8-bit codes; a broken build is off by it all)
    tolerance = 1e-4 if dtype != np.int8 else INT8_TOLERANCE * float(np.abs(_values(v_got)).max())
    if out.shape != want.shape or not np.allclose(out, want, atol=tolerance):
        return f"its {op} differs from numpy's attention (at most {np.abs(out - want).max():.2g})"
    return None


def _turned(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rows x (n, heads, d) turned by rotary tables (n, half), not interleaved, as float32."""
    half = cos.shape[1]
    a, b = x[..., :half], x[..., half:2 * half]
    c, s = cos[:, None], sin[:, None]
    return np.concatenate([a * c - b * s, b * c + a * s, x[..., 2 * half:]], axis=-1).astype(np.float32)


def quantized(rows: np.ndarray) -> np.ndarray:
    """float32 rows (..., d) as attend.c writes them into an int8 KV, (..., d + 2) int8: the codes
    round(x / step) in -127..127, then the step's exponent e and mantissa byte b, step =
    2^e (1 + (b + 128) / 256), the least such at or above the row's largest magnitude / 127."""
    top = np.maximum(np.abs(rows).max(-1, keepdims=True), np.float32(QUANT_SMALLEST))
    f, ex = np.frexp(top / np.float32(127))  # f in [0.5, 1)
    m = np.ceil((2 * f - 1) * 256).astype(np.int32)
    e = np.where(m > 255, ex, ex - 1)
    m = np.where(m > 255, 0, m)
    step = np.ldexp(1 + m / 256, e).astype(np.float32)
    codes = np.clip(np.rint(rows / step), -127, 127)
    return np.concatenate([codes, e, m - 128], axis=-1).astype(np.int8)


MATMUL_OPS = ("MatMul4", "MatMul6", "MatMul4K", "MatMul8")  # (bit i of edgelite_matmul_fast: op i)


def matmul_kinds(library: Path) -> frozenset[str]:
    """The library's products that have their vector path: all four with AVX-512 VNNI and VBMI,
    MatMul4 and MatMul8 with AVX2; elsewhere onnxruntime's MatMulNBits is the faster product
    (engine/linear.py leaves it)."""
    try:
        mask = int(ctypes.CDLL(str(library)).edgelite_matmul_fast())
    except (OSError, AttributeError):
        return frozenset()
    return frozenset(op for i, op in enumerate(MATMUL_OPS) if mask >> i & 1)


def fast_matmul(library: Path) -> bool:
    """Whether every product of the library has its vector path (AVX-512 VNNI and VBMI): a
    range's weights are then held as the export stores them, whatever their kind."""
    return matmul_kinds(library) == frozenset(MATMUL_OPS)


def matmul4(a: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """What matmul.c's MatMul4 computes, in numpy: a (m, K) float32 by 4-bit codes (N, K/32,
    16) (element 2j of a block in byte j's low half, 2j + 1 in its high half) less 8, times
    scales (N, K/32); each row of a quantized per block of 32 (round(a x 127 / largest), to
    even)."""
    w = np.stack([codes & 15, codes >> 4], -1).reshape(*codes.shape[:2], 32).astype(np.float64) - 8
    return _block_product(a, w, scales)


def _block_product(a: np.ndarray, w: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """a (m, K) float32 by integer weights w (N, K / block, block) times scales (N, K / block):
    each block of a row quantized to codes round(a x 127 / largest) (to even) and a step,
    largest / 127, as matmul.c's operators (and MatMulNBits' accuracy level 4) do."""
    m, k = a.shape
    block = w.shape[2]
    blocks = a.reshape(m, k // block, block)
    top = np.abs(blocks).max(-1, keepdims=True)
    inv = np.where(top > 0, np.float32(127) / np.where(top > 0, top, 1), 0).astype(np.float32)
    q = np.clip(np.rint(blocks * inv), -127, 127)
    steps = (top / np.float32(127)).astype(np.float32)[..., 0]
    dots = np.einsum("mbj,nbj->mnb", q.astype(np.float64), w)
    out = np.einsum("mnb,nb,mb->mn", dots, scales.astype(np.float64), steps.astype(np.float64))
    return out.astype(np.float32)


def interleaved(codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MatMul4's codes (N/4, B/4, 4, 64) and scales (N/4, B/4, 4, 4) from MatMulNBits' (N,
    K/32, 16) and (N, K/32): blocks padded with zeros to B, a multiple of 4, four columns
    interleaved (as engine/linear.py's nodes make them)."""
    n, blocks = scales.shape
    pad = -blocks % 4
    codes = np.concatenate([codes, np.zeros((n, pad, 16), np.uint8)], axis=1)
    scales = np.concatenate([scales, np.zeros((n, pad), np.float32)], axis=1)
    b4 = (blocks + pad) // 4
    return (np.ascontiguousarray(codes.reshape(n // 4, 4, b4, 64).transpose(0, 2, 1, 3)),
            np.ascontiguousarray(scales.reshape(n // 4, 4, b4, 4).transpose(0, 2, 1, 3)))


def matmul4k(a: np.ndarray, codes: np.ndarray, sc: np.ndarray, mins: np.ndarray, d: np.ndarray,
             e: np.ndarray) -> np.ndarray:
    """What matmul.c's MatMul4K computes, in numpy: a (m, K) float32 by a Q4_K product, codes
    (N, K/32, 16) as MatMulNBits holds them, scale multiples sc and minimum multiples mins (N,
    K/32) uint8, d and e (N, K/256) float16: block b's weights d sc (code - 8) + (8 d sc + e m),
    the first part by matmul4's quantized rows, the second by each block's exact sum of a."""
    scales = (np.repeat(d.astype(np.float32), 8, axis=1) * sc.astype(np.float32)).astype(np.float32)
    coef = scales.astype(np.float64) * 8 + np.repeat(e, 8, axis=1).astype(np.float64) * mins
    sums = a.reshape(a.shape[0], -1, 32).astype(np.float64).sum(-1)
    return (matmul4(a, codes, scales).astype(np.float64) + sums @ coef.T).astype(np.float32)


def interleaved4k(codes: np.ndarray, sc: np.ndarray, mins: np.ndarray, d: np.ndarray,
                  e: np.ndarray) -> tuple[np.ndarray, ...]:
    """MatMul4K's codes (as MatMul4's), multiples (N/4, K/256, 2, 4, 8) and float16 bases (N/4,
    K/256, 8) from matmul4k's arrays (as engine/linear.py's nodes make them)."""
    n, supers = d.shape
    mult = np.stack([x.reshape(n // 4, 4, supers, 8).transpose(0, 2, 1, 3) for x in (sc, mins)], axis=2)
    base = np.concatenate([d.reshape(n // 4, 4, supers), e.reshape(n // 4, 4, supers)], axis=1)
    return (interleaved(codes, np.zeros(codes.shape[:2], np.float32))[0],
            np.ascontiguousarray(mult),
            np.ascontiguousarray(base.transpose(0, 2, 1)).astype(np.float16))


def matmul8(a: np.ndarray, codes: np.ndarray, scales: np.ndarray, zero: int) -> np.ndarray:
    """What matmul.c's MatMul8 computes, in numpy: a (m, K) float32 by codes (N, K/32, 32) less
    `zero`, times scales (N, K/32); each row of a quantized per block of 32 (as matmul4)."""
    return _block_product(a, codes.astype(np.float64) - zero, scales)


def interleaved8(codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MatMul8's codes (N/4, K/64, 4, 64) and scales (N/4, K/64, 4, 2) from MatMulNBits' (N,
    K/32, 32) and (N, K/32) (as engine/linear.py's nodes make them)."""
    n, blocks = scales.shape
    return (np.ascontiguousarray(codes.reshape(n // 4, 4, blocks // 2, 64).transpose(0, 2, 1, 3)),
            np.ascontiguousarray(scales.reshape(n // 4, 4, blocks // 2, 2).transpose(0, 2, 1, 3)))


def matmul6(a: np.ndarray, codes: np.ndarray, mult: np.ndarray, base: np.ndarray, zero: int) -> np.ndarray:
    """What matmul.c's MatMul6 computes, in numpy: a (m, K) float32 by codes (N, K) (0..63)
    less `zero`, times each block of 16's scale, base (N, K/256) x mult (N, K/16) in float32;
    each row of a quantized per block of 16 (as matmul4)."""
    w = codes.reshape(codes.shape[0], -1, 16).astype(np.float64) - zero
    scales = (np.repeat(base, 16, axis=1) * mult.astype(np.float32)).astype(np.float32)
    return _block_product(a, w, scales)


def pack6(codes: np.ndarray) -> np.ndarray:
    """6-bit codes (..., a multiple of 8) as the exporter's stream holds them: (count / 8, 6)
    bytes, 8 codes in 6, code i at bit 6i."""
    groups = codes.reshape(-1, 8).astype(np.uint64)
    v = np.zeros(len(groups), np.uint64)
    for i in range(8):
        v |= groups[:, i] << np.uint64(6 * i)
    return np.stack([(v >> np.uint64(8 * j)) & np.uint64(255) for j in range(6)], axis=1).astype(np.uint8)


def interleaved6(codes: np.ndarray, mult: np.ndarray, base: np.ndarray) -> tuple[np.ndarray, ...]:
    """MatMul6's codes (N/4, K/256, 4, 192), mult (N/4, K/256, 4, 16) and base (N/4, K/256, 4)
    from codes (N, K), mult (N, K/16) and base (N, K/256) (as engine/linear.py's nodes make
    them from the export's stream)."""
    n, k = codes.shape
    s = k // 256
    stream = pack6(codes).reshape(n // 4, 4, s, 192)
    return (np.ascontiguousarray(stream.transpose(0, 2, 1, 3)),
            np.ascontiguousarray(mult.reshape(n // 4, 4, s, 16).transpose(0, 2, 1, 3)),
            np.ascontiguousarray(base.astype(np.float32).reshape(n // 4, 4, s).transpose(0, 2, 1)))


def random_kv(rng: np.random.Generator, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """Random KV rows of `dtype` (int8: codes, then an exponent and a mantissa byte)."""
    if dtype != np.int8:
        return rng.standard_normal(shape).astype(dtype)
    rows = rng.integers(-127, 128, (*shape[:-1], shape[-1] + 2), dtype=np.int8)
    rows[..., -2] = rng.integers(-9, -3, shape[:-1])
    return rows


def _values(kv: np.ndarray) -> np.ndarray:
    """What KV rows hold, as float64 (int8: codes x 2^e x (1 + (b + 128) / 256))."""
    if kv.dtype != np.int8:
        return kv.astype(np.float64)
    step = np.ldexp(1.0 + (kv[..., -1:].astype(np.float64) + 128) / 256, kv[..., -2:-1].astype(np.int32))
    return kv[..., :-2] * step


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, total: int, heads: int,
               window: int) -> np.ndarray:
    n, kv, d = q.shape[1], k.shape[1], k.shape[3]
    out = np.zeros((1, n, heads * d), np.float32)
    for r in range(n):
        pos = total - n + r
        lo = max(0, pos - window + 1)
        for h in range(heads):
            g = h // (heads // kv)
            s = k[0, g, lo:pos + 1].astype(np.float64) @ q[0, r, h * d:(h + 1) * d] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[0, r, h * d:(h + 1) * d] = p / p.sum() @ v[0, g, lo:pos + 1].astype(np.float64)
    return out


def _model(op: str, heads: int, kv: int, d: int, cap: int, window: int) -> bytes:
    """A model of one attend.c operator (protobuf by hand: phones have no `onnx` package)."""
    kv_elem, row = {"Attend": (FLOAT, d), "Attend16": (FLOAT16, d), "Attend8": (INT8, d + 2)}[op]
    node = make_node(op, ["q", "k_new", "v_new", "k", "v", "total", "cos", "sin"], ["out", "k_out", "v_out"],
                     "attend", DOMAIN, num_heads=heads, kv_num_heads=kv, local_window_size=window,
                     scale=d ** -0.5)
    graph = encode([(GRAPH_NODE, 2, node), (GRAPH_NAME, 2, b"check"),
                    (GRAPH_INPUT, 2, make_value_info("q", FLOAT, [1, "n", heads * d])),
                    (GRAPH_INPUT, 2, make_value_info("k_new", FLOAT, [1, "n", kv * d])),
                    (GRAPH_INPUT, 2, make_value_info("v_new", FLOAT, [1, "n", kv * d])),
                    (GRAPH_INPUT, 2, make_value_info("k", kv_elem, [1, kv, cap, row])),
                    (GRAPH_INPUT, 2, make_value_info("v", kv_elem, [1, kv, cap, row])),
                    (GRAPH_INPUT, 2, make_value_info("total", INT64, [1])),
                    (GRAPH_INPUT, 2, make_value_info("cos", FLOAT, [cap, "half"])),
                    (GRAPH_INPUT, 2, make_value_info("sin", FLOAT, [cap, "half"])),
                    (GRAPH_OUTPUT, 2, make_value_info("out", FLOAT, [1, "n", heads * d])),
                    (GRAPH_OUTPUT, 2, make_value_info("k_out", kv_elem, [1, kv, cap, row])),
                    (GRAPH_OUTPUT, 2, make_value_info("v_out", kv_elem, [1, kv, cap, row]))])
    model = encode([(MODEL_IR_VERSION, 0, 8), (MODEL_GRAPH, 2, graph)])
    return with_opset(with_opset(model, "", 17), DOMAIN, 1)


def _matmul_model(op: str, k: int, n: int, threads: int = 1) -> bytes:
    """A model of one matmul.c operator: (m, k) by n columns (MatMul6: zero point ZERO6)."""
    if op == "MatMul8":
        weights = [make_value_info("codes", UINT8, [n // 4, k // 64, 4, 64]),
                   make_value_info("scales", FLOAT, [n // 4, k // 64, 4, 2])]
        node = make_node(op, ["a", "codes", "scales"], ["y"], "matmul", DOMAIN, K=k, N=n, zero=ZERO8,
                         threads=threads)
    elif op == "MatMul4":
        b4 = -(-k // 128)
        weights = [make_value_info("codes", UINT8, [n // 4, b4, 4, 64]),
                   make_value_info("scales", FLOAT, [n // 4, b4, 4, 4])]
        node = make_node(op, ["a", "codes", "scales"], ["y"], "matmul", DOMAIN, K=k, N=n, threads=threads)
    elif op == "MatMul4K":
        s = k // 256
        weights = [make_value_info("codes", UINT8, [n // 4, 2 * s, 4, 64]),
                   make_value_info("mult", UINT8, [n // 4, s, 2, 4, 8]),
                   make_value_info("base", FLOAT16, [n // 4, s, 8])]
        node = make_node(op, ["a", "codes", "mult", "base"], ["y"], "matmul", DOMAIN, K=k, N=n,
                         threads=threads)
    else:
        s = k // 256
        weights = [make_value_info("codes", UINT8, [n // 4, s, 4, 192]),
                   make_value_info("mult", INT8, [n // 4, s, 4, 16]),
                   make_value_info("base", FLOAT, [n // 4, s, 4])]
        node = make_node(op, ["a", "codes", "mult", "base"], ["y"], "matmul", DOMAIN, K=k, N=n, zero=ZERO6,
                         threads=threads)
    graph = encode([(GRAPH_NODE, 2, node), (GRAPH_NAME, 2, b"check"),
                    (GRAPH_INPUT, 2, make_value_info("a", FLOAT, ["m", k])),
                    *((GRAPH_INPUT, 2, w) for w in weights),
                    (GRAPH_OUTPUT, 2, make_value_info("y", FLOAT, ["m", n]))])
    model = encode([(MODEL_IR_VERSION, 0, 8), (MODEL_GRAPH, 2, graph)])
    return with_opset(with_opset(model, "", 17), DOMAIN, 1)


def command(cc: str, extra: list[str], target: str) -> list[str]:
    """The compiler's command line that builds the library at `target` (`extra`: flags)."""
    return [cc, *FLAGS, *extra, "-I", str(SOURCE.parent), "-o", target, *(str(p) for p in SOURCES), "-lm"]


def _compile(cc: str, native: str | None, target: Path, timeout_s: float) -> str | None:
    """None when `target` was built; else what went wrong, in one line."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as exc:
        return f"cannot write in {target.parent}: {exc}"
    cmd = command(cc, [native] if native else [], tmp)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        if done.returncode:
            lines = (done.stderr or done.stdout).strip().splitlines()
            return f"{Path(cc).name} {native or ''}: {lines[0] if lines else f'exit {done.returncode}'}"
        os.replace(tmp, target)  # (atomic: other processes see the whole library or none)
        return None
    except subprocess.TimeoutExpired:
        return f"{Path(cc).name} took over {timeout_s:.0f} s"
    except OSError as exc:
        return f"{Path(cc).name}: {exc}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
