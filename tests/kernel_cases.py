"""The kernel library's check cases, run on every path: products of each kind (blocks padded and
not, tiles of rows and one more) and attention steps (each KV dtype, group sizes, head sizes, a
window, decode rows and chunks), random inputs from a fixed seed. Each path's outputs must be
the reference's bit for bit (one digest for all) and near the numpy twins; rows alone must be
the rows of a chunk. Runs in this process through the library's plain C entry points
(ctypes), or through tests/kernel_driver.c (a process of another ISA, under qemu) from a case
file."""

from __future__ import annotations

import ctypes
import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgelite.engine.kernels import twins
from edgelite.engine.kernels.check import product_case

KINDS = {"MatMul4": 0, "MatMul6": 1, "MatMul4K": 2, "MatMul8": 3}
DTYPES = {0: np.float32, 1: np.float16, 2: np.int8}
PATHS = ("ref", "avx2", "avx512", "neon", "dotprod", "i8mm")
PRODUCTS = [
    ("MatMul4", 96, 8),
    ("MatMul4", 960, 12),
    ("MatMul4", 2048, 8),
    ("MatMul6", 256, 8),
    ("MatMul6", 512, 4),
    ("MatMul4K", 256, 8),
    ("MatMul4K", 768, 4),
    ("MatMul8", 64, 8),
    ("MatMul8", 192, 12),
    ("MatMul8", 256, 4),
]
ROWS = (1, 2, 3, 4, 5, 7, 9)
# (kind, heads, kv heads, head size, total after the step, the step's rows, window)
ATTENTION = [
    (kind, h, kv, d, total, n, w)
    for kind in (0, 1, 2)
    for h, kv, d in (
        (4, 2, 16),
        (6, 2, 64),
        (3, 3, 64),
        (8, 1, 64),
        (12, 4, 32),
        (9, 1, 64),
        (4, 4, 128),
        (2, 1, 24),
    )
    for total, n, w in ((13, 3, -1), (50, 1, -1), (100, 37, -1), (300, 1, -1), (200, 20, 40), (77, 1, 33))
]


@dataclass
class Product:
    op: str
    a: np.ndarray
    weights: list[np.ndarray]
    zero: int
    want: np.ndarray
    n: int


@dataclass
class Norm:
    x: np.ndarray
    skip: np.ndarray | None
    g: np.ndarray
    eps: float


@dataclass
class Step:
    kind: int
    heads: int
    kv: int
    window: int
    total: int
    d: int
    q: np.ndarray
    k_new: np.ndarray
    v_new: np.ndarray
    kc: np.ndarray
    vc: np.ndarray
    cos: np.ndarray
    sin: np.ndarray


def products(seed: int = 1) -> list[Product]:
    rng = np.random.default_rng(seed)
    out = []
    for op, k, n in PRODUCTS:
        for rows in ROWS:
            a = rng.standard_normal((rows, k)).astype(np.float32)
            feeds, want = product_case(rng, op, k, n, a)
            zero = {"MatMul8": twins.ZERO8, "MatMul6": twins.ZERO6}.get(op, 8)
            out.append(Product(op, a, [np.ascontiguousarray(w) for w in feeds.values()], zero, want, n))
    return out


NORMS = [(rows, d, skip) for rows in (1, 3) for d in (8, 64, 576, 2048) for skip in (False, True)]


def norms(seed: int = 3) -> list[Norm]:
    rng = np.random.default_rng(seed)
    return [Norm(rng.standard_normal((rows, d)).astype(np.float32) * 3,
                 rng.standard_normal((rows, d)).astype(np.float32) if skip else None,
                 rng.uniform(0.5, 1.5, d).astype(np.float32), 1e-5) for rows, d, skip in NORMS]


def steps(seed: int = 2) -> list[Step]:
    rng = np.random.default_rng(seed)
    out = []
    for kind, heads, kv, d, total, n, window in ATTENTION:
        cap, half = total + 5, d // 4
        q = rng.standard_normal((n, heads * d)).astype(np.float32)
        k_new, v_new = (rng.standard_normal((n, kv * d)).astype(np.float32) for _ in range(2))
        kc, vc = (twins.random_kv(rng, (kv, cap, d), DTYPES[kind]) for _ in range(2))
        angles = np.outer(np.arange(cap), 1.0 / 10000 ** (np.arange(half) / half)).astype(np.float32)
        out.append(
            Step(kind, heads, kv, window, total, d, q, k_new, v_new, kc, vc, np.cos(angles), np.sin(angles))
        )
    return out


class Library:
    """The library's plain C entry points (ops.c) in this process."""

    def __init__(self, path: Path) -> None:
        self.lib = lib = ctypes.CDLL(str(path))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.edgelite_matmul.argtypes = [ctypes.c_int, p, i64, i64, i64, i64, p, p, p, p]
        lib.edgelite_attend.argtypes = [
            ctypes.c_int,
            i64,
            i64,
            i64,
            ctypes.c_float,
            i64,
            i64,
            i64,
            i64,
            i64,
            *[p] * 8,
        ]
        lib.edgelite_kernel_use.argtypes = [ctypes.c_char_p]
        lib.edgelite_norm.argtypes = [p, p, p, ctypes.c_float, i64, i64, p, p]
        lib.edgelite_kernel_paths.restype = ctypes.c_char_p

    def paths(self) -> list[str]:
        """The paths of the library this CPU runs (the reference first)."""
        found = [p for p in PATHS if self.lib.edgelite_kernel_use(p.encode())]
        self.lib.edgelite_kernel_use(b"")
        return found

    def use(self, path: str) -> None:
        assert self.lib.edgelite_kernel_use(path.encode()), path

    def product(self, c: Product, rows: slice = slice(None)) -> np.ndarray:
        a = np.ascontiguousarray(c.a[rows])
        y = np.zeros((a.shape[0], c.n), np.float32)
        w = [x.ctypes.data for x in c.weights] + [None] * (3 - len(c.weights))
        assert (
            self.lib.edgelite_matmul(
                KINDS[c.op], a.ctypes.data, a.shape[0], a.shape[1], c.n, c.zero, *w, y.ctypes.data
            )
            == 0
        )
        return y

    def norm(self, c: Norm) -> list[np.ndarray]:
        """The normed rows, and (SkipNorm) the sum."""
        y, total = np.zeros_like(c.x), np.zeros_like(c.x)
        skip = None if c.skip is None else c.skip.ctypes.data
        rows, d = c.x.shape
        sums = None if skip is None else total.ctypes.data
        x, g = c.x.ctypes.data, c.g.ctypes.data
        done = self.lib.edgelite_norm(x, skip, g, c.eps, rows, d, y.ctypes.data, sums)
        assert done == 0
        return [y] if skip is None else [y, total]

    def step(self, s: Step, one_by_one: bool = False) -> list[np.ndarray]:
        """The step's output, and the KV after it (one_by_one: its rows as steps of one row)."""
        kc, vc = s.kc.copy(), s.vc.copy()
        n = s.q.shape[0]
        outs = []
        for lo, hi in [(r, r + 1) for r in range(n)] if one_by_one else [(0, n)]:
            out = np.zeros((hi - lo, s.q.shape[1]), np.float32)
            q, kn, vn = (np.ascontiguousarray(x[lo:hi]) for x in (s.q, s.k_new, s.v_new))
            assert (
                self.lib.edgelite_attend(
                    s.kind,
                    s.heads,
                    s.kv,
                    s.window,
                    0.0,
                    hi - lo,
                    s.total - n + hi,
                    kc.shape[1],
                    s.d,
                    s.cos.shape[1],
                    q.ctypes.data,
                    kn.ctypes.data,
                    vn.ctypes.data,
                    kc.ctypes.data,
                    vc.ctypes.data,
                    s.cos.ctypes.data,
                    s.sin.ctypes.data,
                    out.ctypes.data,
                )
                == 0
            )
            outs.append(out)
        return [np.concatenate(outs), kc, vc]


def digest(arrays: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


# ---- the case file tests/kernel_driver.c reads, and its outputs ----------------------------
def write_cases(path: Path, prods: list[Product], stps: list[Step], nrms: list[Norm]) -> None:
    """Each product as it is, then each step as a chunk and as steps of one row, then each norm."""
    with open(path, "wb") as f:
        for c in prods:
            f.write(
                struct.pack(
                    "<9q",
                    0,
                    KINDS[c.op],
                    c.a.shape[0],
                    c.a.shape[1],
                    c.n,
                    c.zero,
                    *[w.nbytes for w in c.weights],
                    *[0] * (3 - len(c.weights)),
                )
            )
            for x in (c.a, *c.weights):
                f.write(np.ascontiguousarray(x).tobytes())
        for s in stps:
            for one in (0, 1):
                f.write(
                    struct.pack(
                        "<11q",
                        1,
                        s.kind,
                        s.heads,
                        s.kv,
                        s.window,
                        s.q.shape[0],
                        s.total,
                        s.kc.shape[1],
                        s.d,
                        s.cos.shape[1],
                        one,
                    )
                )
                for x in (s.q, s.k_new, s.v_new, s.kc, s.vc, s.cos, s.sin):
                    f.write(np.ascontiguousarray(x).tobytes())
        for c in nrms:
            f.write(struct.pack("<4qf", 2, c.x.shape[0], c.x.shape[1], c.skip is not None, c.eps))
            for x in (c.x, c.g) if c.skip is None else (c.x, c.skip, c.g):
                f.write(np.ascontiguousarray(x).tobytes())


def read_outputs(path: Path, prods: list[Product], stps: list[Step], nrms: list[Norm]) -> list[np.ndarray]:
    """The driver's outputs: each product's, then each step's (chunk, then one row at a time:
    output, KV keys, KV values), then each norm's (and its sum)."""
    data = path.read_bytes()
    at = 0

    def take(shape: tuple[int, ...], dtype: type) -> np.ndarray:
        nonlocal at
        count = int(np.prod(shape)) * np.dtype(dtype).itemsize
        x = np.frombuffer(data[at : at + count], dtype).reshape(shape)
        at += count
        return x

    p_out = [take((c.a.shape[0], c.n), np.float32) for c in prods]
    s_out = []
    for s in stps:
        for _ in (0, 1):
            s_out += [take(s.q.shape, np.float32), take(s.kc.shape, s.kc.dtype), take(s.vc.shape, s.vc.dtype)]
    n_out = [take(c.x.shape, np.float32) for c in nrms for _ in range(1 if c.skip is None else 2)]
    assert at == len(data), (at, len(data))
    return p_out + s_out + n_out
