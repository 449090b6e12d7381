"""Block-quantized weight matrices in the form onnxruntime's MatMulNBits and GatherBlockQuantized
take, made two ways: transcoded from GGUF blocks (no second rounding) or quantized from floats.

A matrix has N rows (output features) and K columns (input features), quantized in blocks of
`block` columns: w[n, k] = scale[n, b] * (q[n, k] - zero[n, b]) + minimum[n, b], b = k // block.
MatMulNBits computes the first term; `minimum` (GGUF's *_1 and K-quant formats, w = d*q + m)
becomes a small extra product of x's block sums with the minima (graph.py).

GGUF layouts follow ggml's reference dequantizers (ggml-quants.c); tests check every type
against the `gguf` package's dequantize.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

QK_K = 256  # super-block of the K-quants
FAST_2BIT_BLOCK = 32  # MatMulNBits' 2-bit kernel (accuracy level 4) is fast from this block size
# quantize_int4's candidate inverse scales: (15 + SEARCH_FROM + i SEARCH_STEP) / (max - min)
SEARCH_STEPS, SEARCH_FROM, SEARCH_STEP = 4, -1.0, 0.5


@dataclass(frozen=True)
class Factored:
    """A per-block matrix (N, K // block) stored small: one float16 per super-block times a
    small integer per block (GGUF's K-quants: d x sc, dmin x m), times `sign`. Exact in
    float32; the graph computes it when the model loads."""

    base: np.ndarray  # (N, S) float16
    mult: np.ndarray  # (N, B) int8 or uint8, B a multiple of S
    sign: float = 1.0
    factor: float = 1.0  # a power of two the values are scaled by (a split's high part)

    def value(self) -> np.ndarray:
        per = self.mult.shape[1] // self.base.shape[1]
        v = np.repeat(self.base.astype(np.float32), per, axis=1) * self.mult.astype(np.float32)
        return v * np.float32(self.sign * self.factor) if self.sign * self.factor != 1 else v

    def rows(self, index: np.ndarray) -> Factored:
        return replace(self, base=self.base[index], mult=self.mult[index])

    def scaled(self, factor: float) -> Factored:
        return replace(self, factor=self.factor * factor)

    @staticmethod
    def concat(parts: list[Factored | None]) -> Factored | None:
        if any(p is None for p in parts):
            return None
        ps: list[Factored] = parts  # type: ignore[assignment]
        first = ps[0]
        if any(p.sign != first.sign or p.factor != first.factor or p.mult.dtype != first.mult.dtype
               or p.mult.shape[1] != first.mult.shape[1] for p in ps):
            return None
        return replace(first, base=np.concatenate([p.base for p in ps]),
                       mult=np.concatenate([p.mult for p in ps]))


@dataclass(frozen=True)
class Blocks:
    q: np.ndarray  # (N, K) uint8 integer codes, each < 2**bits
    scale: np.ndarray  # (N, K // block) float32, exact
    zero: np.ndarray  # (N, K // block) uint8 zero points
    minimum: np.ndarray | None  # (N, K // block) float32, exact; None: no such term
    bits: int  # storage: 4 or 8
    block: int
    scale_fp16: bool = False  # every scale is exactly a float16
    minimum_fp16: bool = False  # every minimum is exactly a float16
    code_bits: int = 0  # bits the codes use (Q5: 5 in 8-bit storage); 0: as `bits`
    # minimum = base + shift * scale with `base` exactly float16 (a centred Q4_1's m + 8d) or
    # factored (a centred K-quant's -dmin m + 8 d sc), or none (0): then it is stored as the
    # base and computed when the model loads
    minimum_parts: tuple[np.ndarray | Factored | None, float] | None = None
    scale_factored: Factored | None = None  # how `scale` is stored (K-quants), when compact
    minimum_factored: Factored | None = None  # how `minimum` is stored, when compact

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape  # type: ignore[return-value]

    @property
    def default_zero(self) -> bool:
        """All zero points are MatMulNBits' default (2**(bits-1)): no zero-point input needed."""
        return bool(np.all(self.zero == 1 << (self.bits - 1)))

    def dequantize(self) -> np.ndarray:
        """(N, K) float32, computed as the graph does (for checks)."""
        n, k = self.shape
        q = self.q.reshape(n, k // self.block, self.block).astype(np.float32)
        w = (q - self.zero[..., None].astype(np.float32)) * self.scale[..., None]
        if self.minimum is not None:
            w = w + self.minimum[..., None]
        return w.reshape(n, k)

    @cached_property
    def narrow(self) -> tuple[np.ndarray, int, int] | None:
        """The codes at their own width, when that is narrower than the storage: (stream, W,
        smallest code), the stream holding each 8 codes (row-major, less the smallest) in W
        bytes, the first in the lowest bits; None when the storage's width is theirs. Computed
        once: a tied table's embedding, head and exact rows all write it."""
        lo = int(self.q.min()) if self.q.size else 0
        width = (int(self.q.max()) - lo).bit_length() if self.q.size else self.bits
        if width >= self.bits or self.q.size % 8:
            return None
        width = max(width, 1)
        values = (self.q.reshape(-1, 8) - np.uint8(lo)).astype(np.uint64)
        word = np.zeros(len(values), np.uint64)
        for j in range(8):
            word |= values[:, j] << np.uint64(width * j)
        del values
        stream = word.view(np.uint8).reshape(-1, 8)[:, :width]  # (little-endian: low bytes)
        return np.ascontiguousarray(stream), width, lo

    def packed(self) -> np.ndarray:
        """MatMulNBits' B: (N, K // block, block * bits // 8) uint8, the first value in the
        lowest bits."""
        n, k = self.shape
        return _pack_bits(self.q.reshape(n, k // self.block, self.block), self.bits)

    def zero_points(self) -> np.ndarray | None:
        """MatMulNBits' zero_points (None when all are the default)."""
        if self.default_zero:
            return None
        per, z = 8 // self.bits, self.zero
        if z.shape[1] % per:
            z = np.concatenate([z, np.zeros((z.shape[0], per - z.shape[1] % per), np.uint8)], axis=1)
        return _pack_bits(z, self.bits)

    def gather_data(self) -> np.ndarray:
        """GatherBlockQuantized's data: (N, K) uint8 for 8 bits, (N, K/2) packed for 4."""
        if self.bits == 8:
            return np.ascontiguousarray(self.q)
        return np.ascontiguousarray(self.q[:, 0::2] | (self.q[:, 1::2] << 4))

    def centered(self) -> Blocks:
        """The same values with zero points at the middle of the code range, the difference
        moved into `minimum` (w = s(q - z) + m = s(q - c) + [m + s(c - z)]). Activations
        quantized to int8 (fast mode) then err against a centred weight: about half the error
        of an all-positive one (measured on SmolLM2's Q4_1: 0.012 -> 0.005 of the output)."""
        centre = 1 << ((self.code_bits or self.bits) - 1)
        if self.minimum is None and (np.all(self.zero == centre)
                                     or not np.all(self.zero == self.zero.flat[0])):
            return self.full_width()  # centred already, or per-block zero points (from floats)
        steps = centre - self.zero.astype(np.float32)
        shift = self.scale * steps
        minimum = shift if self.minimum is None else self.minimum + shift
        parts = None
        if np.all(steps == steps.flat[0]):
            if self.minimum is None:
                parts = (None, float(steps.flat[0]))
            elif self.minimum_factored is not None:
                parts = (self.minimum_factored, float(steps.flat[0]))
            elif self.minimum_fp16:
                parts = (self.minimum, float(steps.flat[0]))
        return replace(self, zero=np.full(self.zero.shape, centre, np.uint8),
                       minimum=minimum.astype(np.float32), minimum_fp16=_fits_fp16(minimum),
                       minimum_parts=parts, minimum_factored=None).full_width()

    def full_width(self) -> Blocks:
        """Narrower codes in 8-bit storage centred at 128, the storage's default zero point
        (q + 128 - z: the same values, and no zero-point input to store, e.g. Q6_K's 1 byte
        per 16 values)."""
        if self.bits != 8 or not self.code_bits or not np.all(self.zero == self.zero.flat[0]):
            return self
        shift = 128 - int(self.zero.flat[0])
        return replace(self, q=(self.q + np.uint8(shift)) if shift >= 0 else self.q - np.uint8(-shift),
                       zero=np.full(self.zero.shape, 128, np.uint8), code_bits=0)

    def rows(self, index: np.ndarray) -> Blocks:
        """The same matrix with its rows reordered (a permutation of output features), or some
        of them."""
        assert self.minimum_parts is None, "rows of a centred matrix"
        return replace(self, q=self.q[index], scale=self.scale[index], zero=self.zero[index],
                       minimum=None if self.minimum is None else self.minimum[index],
                       scale_factored=None if self.scale_factored is None
                       else self.scale_factored.rows(index),
                       minimum_factored=None if self.minimum_factored is None
                       else self.minimum_factored.rows(index))

    @property
    def halves_apply(self) -> bool:
        """Whether `halves` takes it: 8-bit codes around 128 with no minima (Q8_0, int8)."""
        return self.bits == 8 and self.minimum is None and self.default_zero

    def halves(self) -> tuple[Blocks, Blocks]:
        """An 8-bit table (w = d(q - 128)) as two 4-bit ones of the same bytes in all, with no
        minima: hi = q >> 4 (scale 16d, zero point 8), lo = q & 15 (scale d, zero point 0);
        w = 16d(hi - 8) + d lo exactly. The embedding and an exact head share them."""
        assert self.halves_apply
        hi = replace(self, q=self.q >> 4, scale=self.scale * 16, zero=np.full_like(self.zero, 8),
                     bits=4)
        lo = replace(self, q=self.q & 15, zero=np.zeros_like(self.zero), bits=4)
        return hi, lo

    def split_nibbles(self) -> tuple[Blocks, Blocks]:
        """An 8-bit matrix as two exact 4-bit ones, hi and lo (with minimum = m - scale*zero
        folded into lo): MatMulNBits has a fast float-activation kernel for 4 bits only."""
        assert self.bits == 8
        hi = replace(self, q=self.q >> 4, scale=self.scale * 16, zero=np.zeros_like(self.zero),
                     minimum=None, bits=4, minimum_fp16=False, code_bits=0, minimum_parts=None,
                     scale_factored=None if self.scale_factored is None
                     else self.scale_factored.scaled(16), minimum_factored=None)
        shift = -self.scale * self.zero.astype(np.float32)
        minimum = shift if self.minimum is None else self.minimum + shift
        lo = replace(self, q=self.q & 15, zero=np.zeros_like(self.zero), minimum=minimum, bits=4,
                     minimum_fp16=False, code_bits=0, minimum_parts=None, minimum_factored=None)
        return hi, lo

    @property
    def splits_at_width(self) -> bool:
        """5-bit codes in blocks of 32 or more: stored as a 4-bit low part and a 2-bit part
        holding the fifth bit (MatMulNBits has no 5-bit width; its 2-bit kernel is fast only
        from blocks of FAST_2BIT_BLOCK)."""
        return self.code_bits == 5 and self.block >= FAST_2BIT_BLOCK

    def split_5bit(self) -> tuple[Blocks, Blocks]:
        """5-bit codes (in 8-bit storage) as lo = q & 15 (4 bits, the same scale) and hi = q >> 4
        (2-bit storage, scale 16x), zero points 0 and 1: together s(q - 16), the 5-bit codes
        centred (both products quantize the same int8 activations, whose error then meets a
        centred weight), the rest (the original zero point and minimum) in the lo part's
        minimum: w = s lo + 16s(hi - 1) + [m + s(16 - z)]. Fast mode's products."""
        assert self.code_bits == 5
        steps = 16 - self.zero.astype(np.float32)
        shift = self.scale * steps
        minimum = shift if self.minimum is None else self.minimum + shift
        parts = None
        if np.all(steps == steps.flat[0]):
            base = self.minimum_factored if self.minimum_factored is not None else (
                self.minimum if self.minimum is not None and self.minimum_fp16 else None)
            if base is not None or self.minimum is None:
                parts = (base, float(steps.flat[0]))
        if self.minimum is None and not np.any(steps):
            minimum, parts = None, None  # (Q5_0: centred at 16 already)
        lo = replace(self, q=self.q & 15, zero=np.zeros(self.zero.shape, np.uint8),
                     minimum=None if minimum is None else minimum.astype(np.float32), bits=4, code_bits=0,
                     minimum_fp16=minimum is not None and _fits_fp16(minimum), minimum_parts=parts,
                     minimum_factored=None)
        hi = replace(self, q=self.q >> 4, scale=self.scale * 16,
                     zero=np.full(self.zero.shape, 1, np.uint8), minimum=None, bits=2,
                     code_bits=0, minimum_fp16=False, minimum_parts=None, minimum_factored=None,
                     scale_factored=None if self.scale_factored is None
                     else self.scale_factored.scaled(16))
        return lo, hi

    def products(self, compute: str, split5: bool = True) -> list[Blocks]:
        """The MatMulNBits products that sum to this matrix (minima aside), at widths with a
        fast kernel: fast mode (int8 activations) runs 4- and 8-bit storage and 5-bit codes as
        4 + 2 bits (`split5`; else in 8-bit storage: larger, faster), centred; exact mode (float
        activations) has a fast kernel for 4 bits only, so 8-bit storage (5-, 6- and 8-bit
        codes) runs as two 4-bit products."""
        if compute == "exact":
            return list(self.split_nibbles()) if self.bits == 8 else [self]
        if split5 and self.splits_at_width:
            return list(self.split_5bit())
        return [self.centered()]


def _pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Values of `bits` bits packed along the last axis, 8 // bits to a byte, first lowest."""
    if bits == 8:
        return np.ascontiguousarray(q)
    per = 8 // bits
    out = q[..., 0::per].copy()
    for i in range(1, per):
        out |= q[..., i::per] << (bits * i)
    return out


def _fits_fp16(a: np.ndarray) -> bool:
    return bool(np.all(a.astype(np.float16).astype(np.float32) == a))


def concat_rows(parts: list[Blocks]) -> Blocks | None:
    """Stack matrices along N (q, k, v into one projection), or None when their forms differ."""
    first = parts[0]
    if any(p.bits != first.bits or p.block != first.block or p.shape[1] != first.shape[1]
           or p.code_bits != first.code_bits or (p.minimum is None) != (first.minimum is None)
           or (p.scale_factored is None) != (first.scale_factored is None)
           or (p.minimum_factored is None) != (first.minimum_factored is None)
           for p in parts):
        return None
    minima = None if first.minimum is None else np.concatenate([p.minimum for p in parts])  # type: ignore[misc]
    mp = [p.minimum_parts for p in parts]
    joined = None
    if all(x is not None for x in mp) and len({x[1] for x in mp}) == 1:  # type: ignore[index]
        bases = [x[0] for x in mp]  # type: ignore[index]
        if all(b is None for b in bases):
            joined = (None, mp[0][1])  # type: ignore[index]
        elif all(isinstance(b, np.ndarray) for b in bases):
            joined = (np.concatenate(bases), mp[0][1])  # type: ignore[index,arg-type]
        elif (f := Factored.concat(bases)) is not None:  # type: ignore[arg-type]
            joined = (f, mp[0][1])  # type: ignore[index]
    return Blocks(np.concatenate([p.q for p in parts]), np.concatenate([p.scale for p in parts]),
                  np.concatenate([p.zero for p in parts]), minima, first.bits, first.block,
                  all(p.scale_fp16 for p in parts), all(p.minimum_fp16 for p in parts),
                  first.code_bits, joined, Factored.concat([p.scale_factored for p in parts]),
                  Factored.concat([p.minimum_factored for p in parts]))


# ---- quantizing floats (sources without quantized weights) ------------------------------
def quantize_int8(w: np.ndarray, block: int = 32) -> Blocks:
    """Symmetric 8-bit blocks (zero point 128), float16 scales."""
    n, k = w.shape
    wb = w.reshape(n, k // block, block).astype(np.float32)
    scale = (np.abs(wb).max(-1) / 127).astype(np.float16).astype(np.float32)
    safe = np.where(scale == 0, 1, scale)
    q = np.clip(np.rint(wb / safe[..., None]), -127, 127) + 128
    zero = np.full(scale.shape, 128, np.uint8)
    return Blocks(q.astype(np.uint8).reshape(n, k), scale, zero, None, 8, block, scale_fp16=True)


def quantize_int4(w: np.ndarray, block: int = 32, steps: int = SEARCH_STEPS) -> Blocks:
    """4-bit blocks of `block` values, w ~ s q + m (q 0..15; s and m float16, like GGUF's
    Q4_1), each block's s and m chosen by a search that minimises its weighted squared error
    (llama.cpp's make_qkx2_quants: candidate scales around (max - min) / 15, codes rounded for
    each, then s and m fitted by least squares; weights |w| + rms(block) favour large values).
    Floats that sit on such a grid (a dequantized Q4_1) come back exactly."""
    n, k = w.shape
    x = w.reshape(n, k // block, block).astype(np.float32)
    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    span = np.where(hi > lo, hi - lo, 1.0).astype(np.float32)
    weight = np.abs(x) + np.sqrt((x * x).mean(-1, keepdims=True))
    best_s, best_m = span / 15, lo.copy()
    best_err = _block_error(x, weight, best_s, best_m)
    for i in range(steps + 1):
        iscale = (SEARCH_FROM + SEARCH_STEP * i + 15) / span
        q = np.clip(np.rint(iscale * (x - lo)), 0, 15)
        s_, m_ = _fit(x, weight, q)
        err = _block_error(x, weight, s_, m_)
        better = err < best_err
        best_s, best_m, best_err = (np.where(better, s_, best_s), np.where(better, m_, best_m),
                                    np.where(better, err, best_err))
    scale = best_s.astype(np.float16).astype(np.float32)  # stored as float16: codes for those
    minimum = best_m.astype(np.float16).astype(np.float32)
    safe = np.where(scale == 0, 1, scale)
    q = np.clip(np.rint((x - minimum) / safe), 0, 15).astype(np.uint8)
    return Blocks(q.reshape(n, k), scale[..., 0], np.zeros((n, k // block), np.uint8), minimum[..., 0],
                  4, block, scale_fp16=True, minimum_fp16=True)


def _fit(x: np.ndarray, w: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The weighted least-squares s and m of x ~ s q + m per block (last axis)."""
    sw, sq, sx = w.sum(-1, keepdims=True), (w * q).sum(-1, keepdims=True), (w * x).sum(-1, keepdims=True)
    sqq, sqx = (w * q * q).sum(-1, keepdims=True), (w * q * x).sum(-1, keepdims=True)
    det = sw * sqq - sq * sq
    ok = det > 0
    safe = np.where(ok, det, 1.0)
    s = np.where(ok, (sw * sqx - sq * sx) / safe, 0.0)
    m = np.where(ok, (sqq * sx - sq * sqx) / safe, sx / np.where(sw > 0, sw, 1.0))
    return s.astype(np.float32), m.astype(np.float32)


def _block_error(x: np.ndarray, w: np.ndarray, s: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Weighted squared error of x against its best codes for s and m, per block."""
    q = np.clip(np.rint((x - m) / np.where(s == 0, 1, s)), 0, 15)
    d = s * q + m - x
    return (w * d * d).sum(-1, keepdims=True)


# ---- transcoding GGUF blocks -------------------------------------------------------------
def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit layout within 32 values: element j in qs[j] & 15, element j+16 in qs[j] >> 4."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit j of the 32-bit little-endian qh belongs to element j."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return bits.astype(np.uint8)


def _blocks(raw: np.ndarray, n: int, k: int, size: int, per: int) -> np.ndarray:
    return raw.reshape(n, k // per, size)


def from_q4_0(raw: np.ndarray, n: int, k: int) -> Blocks:
    b = _blocks(raw, n, k, 18, 32)
    d, q = _f16(b[..., 0:2]), _nibbles(b[..., 2:])
    return Blocks(q.reshape(n, k), d, np.full(d.shape, 8, np.uint8), None, 4, 32, scale_fp16=True)


def from_q4_1(raw: np.ndarray, n: int, k: int) -> Blocks:
    b = _blocks(raw, n, k, 20, 32)
    d, m, q = _f16(b[..., 0:2]), _f16(b[..., 2:4]), _nibbles(b[..., 4:])
    return Blocks(q.reshape(n, k), d, np.zeros(d.shape, np.uint8), m, 4, 32, scale_fp16=True,
                  minimum_fp16=True)


def from_q5_0(raw: np.ndarray, n: int, k: int) -> Blocks:
    b = _blocks(raw, n, k, 22, 32)
    d = _f16(b[..., 0:2])
    q = _nibbles(b[..., 6:]) | (_high_bits(b[..., 2:6]) << 4)
    return Blocks(q.reshape(n, k), d, np.full(d.shape, 16, np.uint8), None, 8, 32, scale_fp16=True,
                  code_bits=5)


def from_q5_1(raw: np.ndarray, n: int, k: int) -> Blocks:
    b = _blocks(raw, n, k, 24, 32)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    q = _nibbles(b[..., 8:]) | (_high_bits(b[..., 4:8]) << 4)
    return Blocks(q.reshape(n, k), d, np.zeros(d.shape, np.uint8), m, 8, 32, scale_fp16=True,
                  minimum_fp16=True, code_bits=5)


def from_q8_0(raw: np.ndarray, n: int, k: int) -> Blocks:
    b = _blocks(raw, n, k, 34, 32)
    d = _f16(b[..., 0:2])
    q = b[..., 2:] ^ np.uint8(0x80)  # int8 x as uint8 x + 128: the sign bit flipped
    return Blocks(q.reshape(n, k), d, np.full(d.shape, 128, np.uint8), None, 8, 32,
                  scale_fp16=True)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a Q4_K/Q5_K super-block (12 packed bytes)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_low(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 64 values per 32 bytes: sub-block 2i in the low nibbles, 2i+1 in the high."""
    pairs = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([pairs & 15, pairs >> 4], axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _factored(d: np.ndarray, mult: np.ndarray, n: int, sign: float = 1.0) -> Factored:
    """(N, K / QK_K) float16 super-block values times (N, blocks) small integers."""
    return Factored(d.astype(np.float16).reshape(n, -1), np.ascontiguousarray(mult.reshape(n, -1)),
                    sign)


def _k_blocks(d: np.ndarray, dmin: np.ndarray, s: np.ndarray, q: np.ndarray, n: int, k: int,
              bits: int, code_bits: int) -> Blocks:
    sc, mn = _k_scales(s)
    scale_f, min_f = _factored(d, sc, n), _factored(dmin, mn, n, -1.0)
    return Blocks(q.reshape(n, k), scale_f.value(), np.zeros((n, k // 32), np.uint8), min_f.value(),
                  bits, 32, code_bits=code_bits, scale_factored=scale_f, minimum_factored=min_f)


def from_q4_k(raw: np.ndarray, n: int, k: int) -> Blocks:
    b = _blocks(raw, n, k, 144, QK_K)
    return _k_blocks(_f16(b[..., 0:2]), _f16(b[..., 2:4]), b[..., 4:16], _k_low(b[..., 16:]), n,
                     k, 4, 4)


def from_q5_k(raw: np.ndarray, n: int, k: int) -> Blocks:
    b = _blocks(raw, n, k, 176, QK_K)
    qh = b[..., 16:48]  # bit i of qh[l] is the 5th bit of value l of sub-block i
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    q = _k_low(b[..., 48:]) | (high << 4)
    return _k_blocks(_f16(b[..., 0:2]), _f16(b[..., 2:4]), b[..., 4:16], q, n, k, 8, 5)


def from_q6_k(raw: np.ndarray, n: int, k: int) -> Blocks:
    """Q6_K: 16 sub-blocks of 16, w = d * sc * (q - 32), q six bits (stored in 8)."""
    b = _blocks(raw, n, k, 210, QK_K)
    ql, qh, sc, d = b[..., 0:128], b[..., 128:192], b[..., 192:208].view(np.int8), _f16(b[..., 208:210])
    halves = []
    for h in range(2):  # each half: 128 values from 64 bytes of ql and 32 of qh
        lo, hi = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
        parts = [(lo[..., 0:32] & 15) | ((hi >> 0) & 3) << 4, (lo[..., 32:64] & 15) | ((hi >> 2) & 3) << 4,
                 (lo[..., 0:32] >> 4) | ((hi >> 4) & 3) << 4, (lo[..., 32:64] >> 4) | ((hi >> 6) & 3) << 4]
        halves.append(np.concatenate(parts, axis=-1))
    q = np.concatenate(halves, axis=-1).astype(np.uint8)
    scale_f = _factored(d, sc, n)
    return Blocks(q.reshape(n, k), scale_f.value(), np.full((n, k // 16), 32, np.uint8), None, 8, 16,
                  code_bits=6, scale_factored=scale_f)


def from_q2_k(raw: np.ndarray, n: int, k: int) -> Blocks:
    """Q2_K: 16 sub-blocks of 16, w = d (sc & 15) q - dmin (sc >> 4), q two bits (stored in
    4: MatMulNBits' 2-bit kernel is slow for blocks of 16)."""
    b = _blocks(raw, n, k, 84, QK_K)
    sc, qs, d, dmin = b[..., 0:16], b[..., 16:80], _f16(b[..., 80:82]), _f16(b[..., 82:84])
    # each 32 bytes hold 4 x 32 values: value l of group g is (qs[l] >> 2g) & 3
    q = (qs.reshape(n, -1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    scale_f, min_f = _factored(d, sc & 15, n), _factored(dmin, sc >> 4, n, -1.0)
    return Blocks(q.reshape(n, k).astype(np.uint8), scale_f.value(), np.zeros((n, k // 16), np.uint8),
                  min_f.value(), 4, 16, code_bits=2, scale_factored=scale_f, minimum_factored=min_f)


def from_q3_k(raw: np.ndarray, n: int, k: int) -> Blocks:
    """Q3_K: 16 sub-blocks of 16, w = d (sc - 32) (q - 4), q three bits (two in qs, the third
    in hmask; stored in 4), sc six bits."""
    b = _blocks(raw, n, k, 110, QK_K)
    hmask, qs, s, d = b[..., 0:32], b[..., 32:96], b[..., 96:108], _f16(b[..., 108:110])
    lo = (s[..., 0:8, None] >> np.array([0, 4], np.uint8)).swapaxes(-1, -2).reshape(n, -1, 16) & 15
    hi = (s[..., 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)).swapaxes(-1, -2).reshape(n, -1, 16) & 3
    sc = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8)
    low = (qs.reshape(n, -1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    high = (hmask.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    q = low.reshape(n, -1, 256) | (high.reshape(n, -1, 256) << 2)
    scale_f = _factored(d, sc, n)
    return Blocks(q.reshape(n, k).astype(np.uint8), scale_f.value(), np.full((n, k // 16), 4, np.uint8),
                  None, 4, 16, code_bits=3, scale_factored=scale_f)


TRANSCODERS = {"Q4_0": from_q4_0, "Q4_1": from_q4_1, "Q5_0": from_q5_0, "Q5_1": from_q5_1,
               "Q8_0": from_q8_0, "Q2_K": from_q2_k, "Q3_K": from_q3_k, "Q4_K": from_q4_k,
               "Q5_K": from_q5_k, "Q6_K": from_q6_k}
