"""Hostile shapes for the kernel library's operators: one-operator models whose attributes or
inputs are not what edgelite's exporter writes (heads whose product with the head size wraps,
zero rows, KV positions past the KV, negative totals, zero KV heads, weights that do not fit K
and N, a norm over a width no path takes). Each must end in an onnxruntime error naming the
operator (or, for empty inputs, an empty result), the process alive, and a good call after it
still right. Also the library's plain C entry points with the same shapes (-1, nothing
touched). Runs in this process (tests/test_kernel_hostile.py) or as a script in a process of
its own (`python tests/kernel_hostile.py LIBRARY`: the AddressSanitizer build, preloaded),
printing one line a case and exiting 1 when any case failed."""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgelite.engine.kernels.models import DOMAIN, one_node_model
from edgelite.engine.onnxgraph import FLOAT, INT64, UINT8, make_node, make_value_info

WRAPS = 2**60 + 3  # heads whose product with a head size of 16 wraps to 48 in 64 bits


@dataclass
class Case:
    name: str
    model: bytes
    feeds: dict[str, np.ndarray]
    error: str | None  # what the error names (None: the call succeeds, its outputs empty)
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # the outputs' shapes when it succeeds


def free_model(op: str, inputs: dict[str, tuple[int, int]], outputs: dict[str, tuple[int, int]],
               **attrs: int | float) -> bytes:
    """One operator whose inputs' and outputs' shapes are all free (name: (rank, element type)):
    any shape reaches the kernel, onnxruntime checks none."""

    def free(name: str, rank: int, elem: int) -> bytes:
        return make_value_info(name, elem, [f"{name}{i}" for i in range(rank)])

    node = make_node(op, list(inputs), list(outputs), "hostile", DOMAIN, **attrs)
    return one_node_model(node, [free(n, r, e) for n, (r, e) in inputs.items()],
                          [free(n, r, e) for n, (r, e) in outputs.items()])


def attend_any(heads: int, kv: int) -> bytes:
    """An Attend (float32 KV) over inputs of any shape."""
    ins = {"q": (3, FLOAT), "k_new": (3, FLOAT), "v_new": (3, FLOAT), "k": (4, FLOAT), "v": (4, FLOAT),
           "total": (1, INT64), "cos": (2, FLOAT), "sin": (2, FLOAT)}
    return free_model("Attend", ins, {"out": (3, FLOAT), "k_out": (4, FLOAT), "v_out": (4, FLOAT)},
                      num_heads=heads, kv_num_heads=kv, local_window_size=-1, scale=0.25)


def matmul_any(op: str, k: int, n: int) -> bytes:
    """A MatMul4 or MatMul8 over weights of any shape."""
    ins = {"a": (2, FLOAT), "codes": (4, UINT8), "scales": (4, FLOAT)}
    return free_model(op, ins, {"y": (2, FLOAT)}, K=k, N=n, threads=1)


def norm_any(skip: bool) -> bytes:
    ins = {"x": (2, FLOAT), **({"skip": (2, FLOAT)} if skip else {}), "g": (1, FLOAT)}
    outs = {"y": (2, FLOAT), "sum": (2, FLOAT)} if skip else {"y": (2, FLOAT)}
    return free_model("SkipNorm" if skip else "Norm", ins, outs, epsilon=1e-5)


def attend_feeds(
    n: int, q_width: int, kv: int, d: int, cap: int, total: int, cos_rows: int | None = None
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    rows = cap if cos_rows is None else cos_rows
    return {
        "q": rng.standard_normal((1, n, q_width)).astype(np.float32),
        "k_new": rng.standard_normal((1, n, kv * d)).astype(np.float32),
        "v_new": rng.standard_normal((1, n, kv * d)).astype(np.float32),
        "k": np.zeros((1, kv, cap, d), np.float32),
        "v": np.zeros((1, kv, cap, d), np.float32),
        "total": np.array([total], np.int64),
        "cos": np.ones((rows, d // 4), np.float32),
        "sin": np.zeros((rows, d // 4), np.float32),
    }


def batch_feeds(one: dict[str, np.ndarray], batch: int, totals: list[int]) -> dict[str, np.ndarray]:
    """`one` session's feeds repeated over a batch, with these totals."""
    rows = ("q", "k_new", "v_new", "k", "v")
    return {**{k: np.repeat(one[k], batch, axis=0) for k in rows},
            "total": np.array(totals, np.int64), "cos": one["cos"], "sin": one["sin"]}


def cases() -> list[Case]:
    """Every hostile case, and (first) the good ones each is followed by."""
    d, cap = 16, 24
    out = [
        Case("Attend heads x d wraps (2^60+3 heads)", attend_any(WRAPS, 1),
             attend_feeds(1, 48, 1, d, cap, 5), "Attend"),
        Case("Attend with zero rows", attend_any(4, 2), attend_feeds(0, 4 * d, 2, d, cap, 5), "Attend"),
        Case("Attend total past the KV", attend_any(4, 2), attend_feeds(1, 4 * d, 2, d, cap, 1000), "Attend"),
        Case("Attend total negative", attend_any(4, 2), attend_feeds(1, 4 * d, 2, d, cap, -5), "Attend"),
        Case("Attend kv_num_heads 0", attend_any(4, 0), attend_feeds(1, 4 * d, 2, d, cap, 5), "Attend"),
        Case("Attend q wider than heads x d", attend_any(4, 2), attend_feeds(1, 5 * d, 2, d, cap, 5),
             "Attend"),
        Case("Attend rotary tables shorter than total", attend_any(4, 2),
             attend_feeds(1, 4 * d, 2, d, cap, 20, cos_rows=8), "Attend"),
        Case("Attend head size 12", attend_any(4, 2), attend_feeds(1, 48, 2, 12, cap, 5), "Attend"),
        Case("Attend 2^40 KV positions claimed", attend_any(4, 2),
             attend_feeds(1, 4 * d, 2, d, cap, 2**40), "Attend"),
        # a batch of sessions' steps: the KV, the new rows and the totals must all be the batch's
        Case("Attend batch of 3 over one session's KV", attend_any(4, 2),
             {**attend_feeds(1, 4 * d, 2, d, cap, 5),
              "q": np.ones((3, 1, 4 * d), np.float32)}, "Attend"),
        Case("Attend batch of 2 with one total", attend_any(4, 2),
             batch_feeds(attend_feeds(1, 4 * d, 2, d, cap, 5), 2, [5]), "Attend"),
        Case("Attend batch whose second total is past the KV", attend_any(4, 2),
             batch_feeds(attend_feeds(1, 4 * d, 2, d, cap, 5), 2, [5, 1000]), "Attend"),
        Case("Attend batch of 300 sessions", attend_any(4, 2),
             batch_feeds(attend_feeds(1, 4 * d, 2, d, 16, 5, cos_rows=cap), 300, [5] * 300), "Attend"),
    ]
    rng = np.random.default_rng(2)
    a = rng.standard_normal((2, 256)).astype(np.float32)
    small = {"codes": np.zeros((2, 2, 4, 64), np.uint8), "scales": np.zeros((2, 2, 4, 4), np.float32)}
    out += [
        Case("MatMul4 N 2^24 over weights of 8 columns", matmul_any("MatMul4", 256, 2**24), {"a": a, **small},
             "MatMul4"),
        Case("MatMul4 a's width not K", matmul_any("MatMul4", 256, 8),
             {"a": a[:, :128], **small}, "MatMul4"),
        Case("MatMul4 zero rows", matmul_any("MatMul4", 256, 8), {"a": a[:0], **small}, None, [(0, 8)]),
        Case("MatMul8 weights of another K", matmul_any("MatMul8", 128, 8),
             {"a": a[:, :128], "codes": np.zeros((2, 1, 4, 64), np.uint8),
              "scales": np.zeros((2, 1, 4, 2), np.float32)}, "MatMul8"),
        Case("MatMul4 N 0", matmul_any("MatMul4", 256, 0), {"a": a, **small}, "MatMul4"),
    ]
    x = rng.standard_normal((3, 64)).astype(np.float32)
    out += [
        Case("Norm over 12 values", norm_any(False),
             {"x": x[:, :12], "g": np.ones(12, np.float32)}, "Norm"),
        Case("Norm scale of another width", norm_any(False),
             {"x": x, "g": np.ones(32, np.float32)}, "Norm"),
        Case("Norm zero rows", norm_any(False), {"x": x[:0], "g": np.ones(64, np.float32)}, None,
             [(0, 64)]),
        Case("SkipNorm skip of another shape", norm_any(True),
             {"x": x, "skip": x[:2], "g": np.ones(64, np.float32)}, "SkipNorm"),
    ]
    return out


def run_case(ort, opts, case: Case) -> str | None:
    """None when the case ends as it must; else what happened instead."""
    try:
        # (onnxruntime's own shape checks may refuse some at load: that is a refusal too)
        session = ort.InferenceSession(case.model, opts, providers=["CPUExecutionProvider"])
        got = session.run(None, case.feeds)
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
        if case.error is None:
            return f"failed: {str(exc).splitlines()[0]}"
        first = str(exc).splitlines()[0]
        return None if case.error in str(exc) else f"failed without naming {case.error}: {first}"
    if case.error is not None:
        return "ran"
    shapes = [tuple(o.shape) for o in got[: len(case.shapes)]]
    return None if shapes == case.shapes else f"outputs {shapes}, not {case.shapes}"


def good_call(ort, opts) -> str | None:
    """None when a well-shaped Attend still gives finite numbers after the hostile ones."""
    d, cap = 16, 24
    session = ort.InferenceSession(attend_any(4, 2), opts, providers=["CPUExecutionProvider"])
    out = session.run(None, attend_feeds(3, 4 * d, 2, d, cap, 5))[0]
    right = out.shape == (1, 3, 4 * d) and np.isfinite(out).all() and np.abs(out).sum() > 0
    return None if right else "wrong"


def entry_points(library: Path) -> list[str]:
    """The plain C entry points with hostile shapes: each must answer -1 (nothing touched)."""
    lib = ctypes.CDLL(str(library))
    f, i64 = ctypes.c_float, ctypes.c_int64
    lib.edgelite_attend.argtypes = [ctypes.c_int, i64, i64, i64, f, i64, i64, i64, i64, i64,
                                    *[ctypes.c_void_p] * 8]
    lib.edgelite_matmul.argtypes = [ctypes.c_int, ctypes.c_void_p, i64, i64, i64, i64, *[ctypes.c_void_p] * 4]
    lib.edgelite_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, f, i64, i64,
                                  ctypes.c_void_p, ctypes.c_void_p]
    buf = np.zeros(4096, np.float32)
    p = buf.ctypes.data
    wrong = []
    for label, args in (
        ("heads wrap", (0, WRAPS, 1, -1, 0.0, 1, 5, 24, 16, 4)),
        ("zero rows", (0, 4, 2, -1, 0.0, 0, 5, 24, 16, 4)),
        ("total past the KV", (2, 4, 2, -1, 0.0, 1, 100, 24, 16, 4)),
        ("kv heads 0", (1, 4, 0, -1, 0.0, 1, 5, 24, 16, 4)),
        ("kind 7", (7, 4, 2, -1, 0.0, 1, 5, 24, 16, 4)),
        ("rows x heads x d overflows", (0, 1024, 1, -1, 0.0, 2**62, 2**62, 2**62, 16, 4)),
    ):
        if lib.edgelite_attend(*args, *[p] * 8) != -1:
            wrong.append(f"edgelite_attend with {label} did not refuse")
    for label, args in (("zero rows", (0, p, 0, 256, 8, 8)), ("N not of groups", (0, p, 1, 256, 6, 8)),
                        ("kind 9", (9, p, 1, 256, 8, 8)), ("MatMul8 K 100", (3, p, 1, 100, 8, 128))):
        if lib.edgelite_matmul(*args, p, p, p, p) != -1:
            wrong.append(f"edgelite_matmul with {label} did not refuse")
    for rows, width in ((0, 64), (2, 12)):
        if lib.edgelite_norm(p, None, p, 1e-5, rows, width, p, None) != -1:
            wrong.append(f"edgelite_norm over {rows} rows of {width} values did not refuse")
    return wrong


def run(library: Path) -> list[str]:
    """What went wrong over every case (empty: all held)."""
    import onnxruntime as ort

    from edgelite.config import RuntimeConfig
    from edgelite.engine import session

    # (edgelite's options: in a process whose onnxruntime has its global thread pool, as the
    # test suite's has, sessions must use it)
    opts = session.options(RuntimeConfig(threads=1), Path("."))
    opts.log_severity_level = 4
    opts.register_custom_ops_library(str(library))
    wrong = [f"{case.name}: {w}" for case in cases() if (w := run_case(ort, opts, case))]
    if good_call(ort, opts):
        wrong.append("a good Attend after the hostile cases gave wrong numbers")
    return wrong + entry_points(library)


if __name__ == "__main__":
    problems = run(Path(sys.argv[1]))
    for line in problems:
        sys.stdout.write(line + "\n")
    sys.stdout.write(f"{len(cases())} cases, {len(problems)} wrong\n")
    sys.exit(1 if problems else 0)
