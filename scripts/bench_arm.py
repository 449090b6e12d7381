"""Instructions per weight byte of each ARM product path (engine/kernels), counted under qemu-user
on this x86 machine, beside a ggml-shaped Q4_0 x Q8_0 dot loop (scripts/arm_ggml_q4.c, written
for this count only): emulated speed means nothing, the count of instructions a product executes
is deterministic and is the speed proxy here.

Each count is the difference between a product of N and of 2N columns (the same K and rows), so
the process's start, the case file's reading and each row's quantizing cancel out; divided by
the difference in weight bytes (codes, scales, multiples and bases, as the operator reads them;
Q4_0: 18 bytes a block of 32). Rows 1 (a decode step), 2 and 4 (prompt chunks, verification
steps): i8mm takes rows in pairs. The library is cross-built with the production flags (-O3,
cpu.py) with every ARM path; qemu runs `-cpu max,sme=off` (dotprod and i8mm) and counts with
`-d in_asm,exec,nochain` (each translated block's instructions, times its executions).

With --gguf, each path's figure for that model's mix of products: the paths' counts weighted by
the bytes of the GGUF's product tensors of each kind (Q4_0: MatMul4, Q4_K: MatMul4K, Q6_K:
MatMul6, Q8_0: MatMul8; the embedding counts once, as the tied head reads it a token).

    python scripts/bench_arm.py [--k 2048] [--n 256] [--gguf MODEL.gguf]   (prints JSON)
Needs qemu-user and gcc-aarch64-linux-gnu (and the gguf package for --gguf).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
CC = "aarch64-linux-gnu-gcc"
SYSROOT = "/usr/aarch64-linux-gnu"
CPU = "max,sme=off"
KINDS = ("MatMul4", "MatMul4K", "MatMul6", "MatMul8")
PATHS = ("neon", "dotprod", "i8mm")
ROWS = (1, 2, 4)
GGUF_KINDS = {"Q4_0": "MatMul4", "Q4_K": "MatMul4K", "Q6_K": "MatMul6", "Q8_0": "MatMul8"}
TB = re.compile(r"^Trace \d+: 0x[0-9a-f]+ \[[0-9a-f]+/([0-9a-f]+)/")


def weight_bytes(kind: str, k: int, n: int) -> float:
    """The bytes a product reads of its weights (N columns of K)."""
    per = {
        "MatMul4": k / 2 + 4 * k / 32,
        "MatMul4K": k / 2 + 2 * k / 32 + 4 * k / 256,
        "MatMul6": 0.75 * k + k / 16 + 4 * k / 256,
        "MatMul8": k + 4 * k / 32,
        "Q4_0": 18 * k / 32,
    }[kind]
    return per * n


def count(cmd: list[str], log: Path) -> int:
    """Instructions the emulated command executes: each translated block's instructions (from
    `in_asm`), summed over its executions (`exec`, unchained)."""
    subprocess.run(
        ["qemu-aarch64", "-cpu", CPU, "-L", SYSROOT, "-d", "in_asm,exec,nochain", "-D", str(log), *cmd],
        check=True,
        capture_output=True,
        timeout=1800,
    )
    sizes: dict[str, int] = {}
    block, total = None, 0
    with open(log) as f:
        for line in f:
            if line.startswith("IN:"):
                block = None
            elif line.startswith("0x") and ":  " in line:
                pc = line.split(":", 1)[0][2:].lstrip("0") or "0"
                if block is None:
                    block = pc
                    sizes[block] = 0
                sizes[block] += 1
            elif line.startswith("Trace"):
                found = TB.match(line)
                if found:
                    total += sizes.get(found.group(1).lstrip("0") or "0", 0)
    log.unlink()
    return total


def model_mix(path: Path) -> dict[str, float]:
    """Each product kind's share of a GGUF's quantized weight bytes (the kinds GGUF_KINDS maps)."""
    from gguf import GGUFReader

    weights: dict[str, float] = {}
    for tensor in GGUFReader(str(path)).tensors:
        kind = GGUF_KINDS.get(tensor.tensor_type.name)
        if kind is not None:
            weights[kind] = weights.get(kind, 0.0) + float(tensor.n_bytes)
    total = sum(weights.values())
    return {kind: round(b / total, 4) for kind, b in weights.items()}


def mixed(per: dict[str, dict[str, dict[int, float]]], mix: dict[str, float]) -> dict[str, dict[int, float]]:
    """Each path's instructions per weight byte over a model's mix, at each row count it has."""
    out: dict[str, dict[int, float]] = {}
    for p in PATHS:
        for rows in ROWS:
            if all(rows in per[kind].get(p, {}) for kind in mix):
                out.setdefault(p, {})[rows] = round(
                    sum(share * per[kind][p][rows] for kind, share in mix.items()), 3
                )
    return out


def main() -> None:
    import kernel_cases as kc

    from edgelite.engine.kernels import build
    from edgelite.engine.kernels.check import product_case

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--n", type=int, default=256, help="columns of the smaller product (the other: 2n)")
    parser.add_argument(
        "--gguf", type=Path, help="also weight each path's counts by this model's mix of products"
    )
    args = parser.parse_args()
    k, n = args.k, args.n
    work = Path(tempfile.mkdtemp(prefix="bench-arm-"))
    started = time.monotonic()
    library, error = build.Build(
        CC, "arm", frozenset({"asimd", "asimddp", "i8mm"}), every=True, folder=work / "lib"
    ).run()
    if library is None:
        raise SystemExit(f"cannot cross-build the library: {error}")
    driver, ggml = work / "driver", work / "ggml"
    subprocess.run(
        [CC, "-O1", "-o", str(driver), str(REPO / "tests" / "kernel_driver.c"), "-ldl"], check=True
    )
    subprocess.run(
        [CC, "-O3", "-march=armv8.2-a+dotprod", "-o", str(ggml), str(REPO / "scripts" / "arm_ggml_q4.c")],
        check=True,
    )
    rng = np.random.default_rng(0)
    rows_out: dict[str, dict[str, dict[int, float]]] = {}
    for kind in KINDS:
        for rows in ROWS:
            files = []
            for cols in (n, 2 * n):
                a = rng.standard_normal((rows, k)).astype(np.float32)
                feeds, want = product_case(rng, kind, k, cols, a)
                zero = {"MatMul8": 128, "MatMul6": 32}.get(kind, 8)
                weights = [np.ascontiguousarray(w) for w in feeds.values()]
                case = kc.Product(kind, a, weights, zero, want, cols)
                path = work / f"{kind}-{rows}-{cols}"
                kc.write_cases(path, [case], [], [])
                files.append(path)
            for p in PATHS:
                if rows > 1 and p == "neon":
                    continue
                c1, c2 = (
                    count([str(driver), str(library), p, str(f), str(work / "out")], work / "log")
                    for f in files
                )
                per = (c2 - c1) / (weight_bytes(kind, k, 2 * n) - weight_bytes(kind, k, n))
                rows_out.setdefault(kind, {}).setdefault(p, {})[rows] = round(per, 3)
    ggml_out = {}
    for rows in ROWS:
        c1, c2 = (count([str(ggml), str(k), str(cols), str(rows)], work / "log") for cols in (n, 2 * n))
        ggml_out[rows] = round((c2 - c1) / (weight_bytes("Q4_0", k, 2 * n) - weight_bytes("Q4_0", k, n)), 3)
    result: dict[str, object] = {
        "k": k,
        "n": [n, 2 * n],
        "cpu": CPU,
        "instructions_per_weight_byte": rows_out,
        "ggml_q4_0_x_q8_0_loop": ggml_out,
    }
    if args.gguf is not None:
        mix = model_mix(args.gguf)
        result["model"] = {
            "gguf": args.gguf.name,
            "byte_shares": mix,
            "instructions_per_weight_byte": mixed(rows_out, mix),
        }
    result["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
