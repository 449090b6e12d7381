"""Export at any size: wall time, peak memory, size and verification of real-size exports.

    python scripts/bench_export.py --cache ~/.cache/edgelite-bench [--sizes 1b,3b] [--max-memory-mb 2000]
    python scripts/bench_export.py --cache ... --sizes 8b --formats q4_0 --max-memory-mb 3000

For each size, random-weight Llama-shaped models (scripts/random_models.py: HF bf16 safetensors,
sharded past 4 GB, and GGUF Q8_0 and Q4_0 with the same values) are built in --cache once, then
exported by `edgelite-export` in a process of its own: int4 (fast) from the HF folder, the
source's own width from each GGUF. Each line of the JSON gives the wall time, the export
process's peak RSS against --max-memory-mb and against the largest layer's float32 bytes
(memory grows with a layer's width, not with the number of layers), the export's size on disk
against the source's, and the verification figures. Exports are deleted afterwards (--keep
keeps them); --delete-sources removes the built models at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import random_models

CASES = {"hf": ["--quantize", "int4"], "q8_0": [], "q4_0": []}


def largest_layer_float_bytes(size: str) -> int:
    h, _, heads, kv, inter = random_models.SHAPES[size]
    d = h // heads
    return 4 * (h * heads * d * 2 + 2 * h * kv * d + 3 * h * inter)


def source_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir()) if path.is_dir() else path.stat().st_size


def export(src: Path, out: Path, extra: list[str], budget: int) -> dict:
    cmd = [sys.executable, "-m", "edgelite_export", str(src), "--out", str(out), "--json",
           "--force", "--max-memory-mb", str(budget), *extra]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        return {"error": res.stderr.strip().splitlines()[-1:], "seconds": round(wall, 1)}
    out_json = json.loads(res.stdout)
    return {"seconds": round(wall, 1), "peak_rss_bytes": out_json["peak_rss_bytes"],
            "bytes": out_json["bytes"], "verification": out_json["verification"],
            "weights": out_json["weights"], "compute": out_json["compute"]}


def case(size: str, fmt: str, src: Path, work: Path, budget: int, keep: bool) -> dict:
    out = work / f"{src.stem}-export"
    got = export(src, out, CASES[fmt], budget)
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    row = {"size": size, "source": fmt, "args": CASES[fmt], "budget_mib": budget, **got}
    if "error" in got:
        return row
    v = got.pop("verification")
    layer = largest_layer_float_bytes(size)
    row.update(
        peak_rss_mib=round(got["peak_rss_bytes"] / 2**20),
        largest_layer_float_mib=round(layer / 2**20),
        peak_over_largest_layer=round(got["peak_rss_bytes"] / layer, 2),
        source_mb=round(source_bytes(src) / 1e6), export_mb=round(got["bytes"] / 1e6),
        export_over_source=round(got["bytes"] / source_bytes(src), 3),
        verification={k: v[k] for k in ("origin", "kld", "top1_agreement", "top1_confident",
                                         "confident_positions", "greedy_prefix", "steps",
                                         "transcode_max_rel_diff", "passed", "seconds")}
        | {"max_layer_error": max(v["layer_errors"])})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--sizes", default="1b,3b")
    ap.add_argument("--formats", default="hf,q8_0,q4_0")
    ap.add_argument("--max-memory-mb", type=int, default=2000)
    ap.add_argument("--keep", action="store_true", help="keep the exports")
    ap.add_argument("--delete-sources", action="store_true", help="remove the built models at the end")
    args = ap.parse_args()
    rows = []
    for size in args.sizes.split(","):
        built = random_models.build(args.cache, size, args.formats.split(","))
        for fmt, src in built.items():
            rows.append(case(size, fmt, src, args.cache, args.max_memory_mb, args.keep))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if args.delete_sources:
            for src in built.values():
                shutil.rmtree(src) if src.is_dir() else src.unlink()
    print(json.dumps({"bench": "export", "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                      "exports": rows}, indent=1))


if __name__ == "__main__":
    main()
