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

import numpy as np

QK_K = 256  # super-block of the K-quants


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
    # minimum = base + shift * scale with `base` exactly float16 (a centred Q4_1's m + 8d):
    # then it is stored as the base and computed when the model loads
    minimum_parts: tuple[np.ndarray, float] | None = None

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

    def packed(self) -> np.ndarray:
        """MatMulNBits' B: (N, K // block, block * bits // 8) uint8, low nibble first."""
        n, k = self.shape
        q = self.q.reshape(n, k // self.block, self.block)
        if self.bits == 8:
            return np.ascontiguousarray(q)
        return np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4))

    def zero_points(self) -> np.ndarray | None:
        """MatMulNBits' zero_points (None when all are the default)."""
        if self.default_zero:
            return None
        if self.bits == 8:
            return np.ascontiguousarray(self.zero)
        z = self.zero
        if z.shape[1] % 2:
            z = np.concatenate([z, np.zeros((z.shape[0], 1), np.uint8)], axis=1)
        return np.ascontiguousarray(z[:, 0::2] | (z[:, 1::2] << 4))

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
            return self  # centred already, or per-block integer zero points (quantized floats)
        steps = centre - self.zero.astype(np.float32)
        shift = self.scale * steps
        minimum = shift if self.minimum is None else self.minimum + shift
        parts = None
        if self.minimum is not None and self.minimum_fp16 and np.all(steps == steps.flat[0]):
            parts = (self.minimum, float(steps.flat[0]))
        return replace(self, zero=np.full(self.zero.shape, centre, np.uint8),
                       minimum=minimum.astype(np.float32), minimum_fp16=_fits_fp16(minimum),
                       minimum_parts=parts)

    def rows(self, index: np.ndarray) -> Blocks:
        """The same matrix with its rows reordered (a permutation of output features)."""
        return replace(self, q=self.q[index], scale=self.scale[index], zero=self.zero[index],
                       minimum=None if self.minimum is None else self.minimum[index])

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
                     minimum=None, bits=4, minimum_fp16=False, code_bits=0, minimum_parts=None)
        shift = -self.scale * self.zero.astype(np.float32)
        minimum = shift if self.minimum is None else self.minimum + shift
        lo = replace(self, q=self.q & 15, zero=np.zeros_like(self.zero), minimum=minimum, bits=4,
                     minimum_fp16=False, code_bits=0, minimum_parts=None)
        return hi, lo


def _fits_fp16(a: np.ndarray) -> bool:
    return bool(np.all(a.astype(np.float16).astype(np.float32) == a))


def concat_rows(parts: list[Blocks]) -> Blocks | None:
    """Stack matrices along N (q, k, v into one projection), or None when their forms differ."""
    first = parts[0]
    if any(p.bits != first.bits or p.block != first.block or p.shape[1] != first.shape[1]
           or p.code_bits != first.code_bits or (p.minimum is None) != (first.minimum is None)
           for p in parts):
        return None
    minima = None if first.minimum is None else np.concatenate([p.minimum for p in parts])  # type: ignore[misc]
    mp = [p.minimum_parts for p in parts]
    joined = None
    if all(x is not None for x in mp) and len({x[1] for x in mp}) == 1:  # type: ignore[index]
        joined = (np.concatenate([x[0] for x in mp]), mp[0][1])  # type: ignore[index]
    return Blocks(np.concatenate([p.q for p in parts]), np.concatenate([p.scale for p in parts]),
                  np.concatenate([p.zero for p in parts]), minima, first.bits, first.block,
                  all(p.scale_fp16 for p in parts), all(p.minimum_fp16 for p in parts),
                  first.code_bits, joined)


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


def quantize_int4(w: np.ndarray, block: int = 32) -> Blocks:
    """Asymmetric 4-bit blocks: an integer zero point per block, float16 scales."""
    n, k = w.shape
    wb = w.reshape(n, k // block, block).astype(np.float32)
    lo, hi = np.minimum(wb.min(-1), 0), np.maximum(wb.max(-1), 0)
    scale = ((hi - lo) / 15).astype(np.float16).astype(np.float32)
    safe = np.where(scale == 0, 1, scale)
    zero = np.clip(np.rint(-lo / safe), 0, 15)
    q = np.clip(np.rint(wb / safe[..., None]) + zero[..., None], 0, 15)
    return Blocks(q.astype(np.uint8).reshape(n, k), scale, zero.astype(np.uint8), None, 4, block,
                  scale_fp16=True)


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


def _k_blocks(d: np.ndarray, dmin: np.ndarray, s: np.ndarray, q: np.ndarray, n: int, k: int,
              bits: int, code_bits: int) -> Blocks:
    sc, mn = _k_scales(s)
    scale = (d[..., None] * sc.astype(np.float32)).reshape(n, k // 32)
    minimum = (-(dmin[..., None] * mn.astype(np.float32))).reshape(n, k // 32)
    return Blocks(q.reshape(n, k), scale, np.zeros(scale.shape, np.uint8), minimum, bits, 32,
                  code_bits=code_bits)


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
    scale = (d[..., None] * sc.astype(np.float32)).reshape(n, k // 16)
    return Blocks(q.reshape(n, k), scale, np.full(scale.shape, 32, np.uint8), None, 8, 16,
                  code_bits=6)


TRANSCODERS = {"Q4_0": from_q4_0, "Q4_1": from_q4_1, "Q5_0": from_q5_0, "Q5_1": from_q5_1,
               "Q8_0": from_q8_0, "Q4_K": from_q4_k, "Q5_K": from_q5_k, "Q6_K": from_q6_k}
