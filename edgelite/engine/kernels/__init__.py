"""edgelite's own operators, in C built on the device for its CPU: the attention over the KV
(Attend, Attend16, Attend8) and the products with narrow weights (MatMul4, MatMul4K, MatMul6,
MatMul8), one onnxruntime custom-operator library.

Its sources (src/) are a reference path in plain C and one file per ISA family's path (x86:
AVX2, AVX-512 VNNI; ARM: NEON, dotprod, i8mm), each compiled with its own flags (cpu.py: from
the CPU's features, never -march=native) and chosen at run time from the CPU's features; every
path gives the reference's bits (src/kernels.h). build.py builds and checks it (in a child
process), check.py is that check, twins.py the operators in numpy, models.py one-operator
graphs of them. Where no compiler works or the check fails, the graphs keep onnxruntime's
operators and it says so once.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from edgelite.config import RuntimeConfig
from edgelite.engine.kernels.build import BUILDER
from edgelite.engine.kernels.models import DOMAIN

__all__ = [
    "DOMAIN",
    "HEAD_DIMS",
    "MATMUL_OPS",
    "building",
    "library",
    "matmul_kinds",
    "paths",
    "start",
    "status",
]
HEAD_DIMS = range(8, 257, 8)  # the head sizes the attention computes (multiples of its 8 lanes, up to 256)
MATMUL_OPS = ("MatMul4", "MatMul6", "MatMul4K", "MatMul8")  # (bit i of edgelite_matmul_fast: op i)


def start(cfg: RuntimeConfig) -> None:
    """Start this process's build in the background, if it has not started (a node, at start)."""
    BUILDER.start(cfg)


def building() -> bool:
    """Whether the build has started and not yet ended."""
    return BUILDER.started() and not BUILDER.done()


def status(cfg: RuntimeConfig) -> str:
    """What this process has of the library, without waiting: "off" (turned off), "not built"
    (nothing asked for it yet), "building", "none" (it could not be built), else which path runs
    each operator."""
    if not (cfg.attention_kernel or cfg.matmul_kernel):
        return "off"
    if not BUILDER.started():
        return "not built"
    if not BUILDER.done():
        return "building"
    found = BUILDER.wait(cfg, 0)
    return paths(found) if found is not None else "none"


def library(cfg: RuntimeConfig, wait_s: float | None = None) -> Path | None:
    """The built and checked library (built now, or waited for, up to wait_s); None (logged
    once) when it cannot be built, or not within wait_s."""
    return BUILDER.wait(cfg, wait_s)


@functools.cache
def _exports(library: Path) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(str(library))
    except OSError:
        return None


def matmul_kinds(library: Path) -> frozenset[str]:
    """The library's products that run on a vector path on this CPU (the others would run the
    plain reference, slower than onnxruntime's MatMulNBits: engine/passes/linear.py leaves them)."""
    lib = _exports(library)
    try:
        mask = int(lib.edgelite_matmul_fast()) if lib is not None else 0
    except AttributeError:
        return frozenset()
    return frozenset(op for i, op in enumerate(MATMUL_OPS) if mask >> i & 1)


def paths(library: Path) -> str:
    """Which path runs each operator here, e.g. "MatMul4=avx512 ... Attend8=avx512"."""
    lib = _exports(library)
    if lib is None:
        return ""
    fn = lib.edgelite_kernel_paths
    fn.restype = ctypes.c_char_p
    return fn().decode()
