"""numpy twins of the kernel library's operators (what each computes, in float64 where it
sums: a path must agree with its twin within rounding, and with the reference path bit for bit),
and the weights' layouts the operators take (as engine/passes/linear.py's nodes make them)."""

from __future__ import annotations

import numpy as np

ZERO6 = 32  # the zero point of a Q6_K's codes (0..63), MatMul6's default
ZERO8 = 128  # MatMulNBits' zero point of 8-bit codes without zero points (MatMul8's attribute)
QUANT_SMALLEST = 1e-30  # an int8 KV row of zeros still gets a step (its codes are 0)
# Attend8 against numpy, of the values' largest magnitude (8-bit queries and weights: random
# rows, whose softmax is near one-hot, move by up to 3 %)
INT8_TOLERANCE = 5e-2
# (1 + 2^-11 and 1 + 3 2^-11: ties, to even down and up; 2^-25 and 3 2^-25: subnormal ties;
# 65519 and 65520: the largest float16, infinity)
NARROW_CASES = np.array(
    [1 + 2**-11, 1 + 3 * 2**-11, -(2**-25), 3 * 2**-25, 1e-6, 65519.0, 65520.0, -7e4, -0.0, 2**-14 - 2**-25],
    np.float32,
)


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
    interleaved (as engine/passes/linear.py's nodes make them)."""
    n, blocks = scales.shape
    pad = -blocks % 4
    codes = np.concatenate([codes, np.zeros((n, pad, 16), np.uint8)], axis=1)
    scales = np.concatenate([scales, np.zeros((n, pad), np.float32)], axis=1)
    b4 = (blocks + pad) // 4
    return (
        np.ascontiguousarray(codes.reshape(n // 4, 4, b4, 64).transpose(0, 2, 1, 3)),
        np.ascontiguousarray(scales.reshape(n // 4, 4, b4, 4).transpose(0, 2, 1, 3)),
    )


def matmul4k(
    a: np.ndarray, codes: np.ndarray, sc: np.ndarray, mins: np.ndarray, d: np.ndarray, e: np.ndarray
) -> np.ndarray:
    """What matmul.c's MatMul4K computes, in numpy: a (m, K) float32 by a Q4_K product, codes
    (N, K/32, 16) as MatMulNBits holds them, scale multiples sc and minimum multiples mins (N,
    K/32) uint8, d and e (N, K/256) float16: block b's weights d sc (code - 8) + (8 d sc + e m),
    the first part by matmul4's quantized rows, the second by each block's exact sum of a."""
    scales = (np.repeat(d.astype(np.float32), 8, axis=1) * sc.astype(np.float32)).astype(np.float32)
    coef = scales.astype(np.float64) * 8 + np.repeat(e, 8, axis=1).astype(np.float64) * mins
    sums = a.reshape(a.shape[0], -1, 32).astype(np.float64).sum(-1)
    return (matmul4(a, codes, scales).astype(np.float64) + sums @ coef.T).astype(np.float32)


def interleaved4k(
    codes: np.ndarray, sc: np.ndarray, mins: np.ndarray, d: np.ndarray, e: np.ndarray
) -> tuple[np.ndarray, ...]:
    """MatMul4K's codes (as MatMul4's), multiples (N/4, K/256, 2, 4, 8) and float16 bases (N/4,
    K/256, 8) from matmul4k's arrays (as engine/passes/linear.py's nodes make them)."""
    n, supers = d.shape
    mult = np.stack([x.reshape(n // 4, 4, supers, 8).transpose(0, 2, 1, 3) for x in (sc, mins)], axis=2)
    base = np.concatenate([d.reshape(n // 4, 4, supers), e.reshape(n // 4, 4, supers)], axis=1)
    return (
        interleaved(codes, np.zeros(codes.shape[:2], np.float32))[0],
        np.ascontiguousarray(mult),
        np.ascontiguousarray(base.transpose(0, 2, 1)).astype(np.float16),
    )


def matmul8(a: np.ndarray, codes: np.ndarray, scales: np.ndarray, zero: int) -> np.ndarray:
    """What matmul.c's MatMul8 computes, in numpy: a (m, K) float32 by codes (N, K/32, 32) less
    `zero`, times scales (N, K/32); each row of a quantized per block of 32 (as matmul4)."""
    return _block_product(a, codes.astype(np.float64) - zero, scales)


def interleaved8(codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MatMul8's codes (N/4, K/64, 4, 64) and scales (N/4, K/64, 4, 2) from MatMulNBits' (N,
    K/32, 32) and (N, K/32) (as engine/passes/linear.py's nodes make them)."""
    n, blocks = scales.shape
    return (
        np.ascontiguousarray(codes.reshape(n // 4, 4, blocks // 2, 64).transpose(0, 2, 1, 3)),
        np.ascontiguousarray(scales.reshape(n // 4, 4, blocks // 2, 2).transpose(0, 2, 1, 3)),
    )


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
    from codes (N, K), mult (N, K/16) and base (N, K/256) (as engine/passes/linear.py's nodes make
    them from the export's stream)."""
    n, k = codes.shape
    s = k // 256
    stream = pack6(codes).reshape(n // 4, 4, s, 192)
    return (
        np.ascontiguousarray(stream.transpose(0, 2, 1, 3)),
        np.ascontiguousarray(mult.reshape(n // 4, 4, s, 16).transpose(0, 2, 1, 3)),
        np.ascontiguousarray(base.astype(np.float32).reshape(n // 4, 4, s).transpose(0, 2, 1)),
    )


def random_kv(rng: np.random.Generator, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """Random KV rows of `dtype` (int8: codes, then an exponent and a mantissa byte)."""
    if dtype != np.int8:
        return rng.standard_normal(shape).astype(dtype)
    rows = rng.integers(-127, 128, (*shape[:-1], shape[-1] + 2), dtype=np.int8)
    rows[..., -2] = rng.integers(-9, -3, shape[:-1])
    return rows


def values(kv: np.ndarray) -> np.ndarray:
    """What KV rows hold, as float64 (int8: codes x 2^e x (1 + (b + 128) / 256))."""
    if kv.dtype != np.int8:
        return kv.astype(np.float64)
    step = np.ldexp(1.0 + (kv[..., -1:].astype(np.float64) + 128) / 256, kv[..., -2:-1].astype(np.int32))
    return kv[..., :-2] * step


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, total: int, heads: int, window: int) -> np.ndarray:
    """Attention as the Attend operators compute it, in float64: turned queries q (1, n, heads x d)
    over the KV's values k, v (1, kv, cap, d) of positions up to `total`, each row over its
    window's positions (window: positions a row sees; none: any number over total)."""
    n, kv, d = q.shape[1], k.shape[1], k.shape[3]
    out = np.zeros((1, n, heads * d), np.float32)
    for r in range(n):
        pos = total - n + r
        lo = max(0, pos - window + 1)
        for h in range(heads):
            g = h // (heads // kv)
            s = k[0, g, lo : pos + 1].astype(np.float64) @ q[0, r, h * d : (h + 1) * d] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[0, r, h * d : (h + 1) * d] = p / p.sum() @ v[0, g, lo : pos + 1].astype(np.float64)
    return out


def turned(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rows x (n, heads, d) turned by rotary tables (n, half), not interleaved, as float32."""
    half = cos.shape[1]
    a, b = x[..., :half], x[..., half : 2 * half]
    c, s = cos[:, None], sin[:, None]
    return np.concatenate([a * c - b * s, b * c + a * s, x[..., 2 * half :]], axis=-1).astype(np.float32)


def norm(x: np.ndarray, g: np.ndarray, eps: float, skip: np.ndarray | None = None) -> np.ndarray:
    """What Norm (and SkipNorm, with `skip`) computes, in float64: x (+ skip) over the root of
    its mean square plus eps, times g."""
    s = x.astype(np.float64) + (0 if skip is None else skip.astype(np.float64))
    return (s / np.sqrt((s * s).mean(-1, keepdims=True) + eps) * g).astype(np.float32)
