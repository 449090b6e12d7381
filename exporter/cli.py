"""edgelite-export SOURCE --out DIR [--quantize none|int8|int4] [--mode exact|fast]
edgelite-export upgrade DIR   (list the products of an export made before product kinds)"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from edgelite.errors import EdgeliteError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="edgelite-export",
        description="Cut a Hugging Face or GGUF LLM into verified per-layer ONNX files + manifest.json.")
    p.add_argument("source", help="local HF folder, .gguf file, hub id (org/name) or an alias "
                                  "such as smollm2-135m")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--quantize", choices=["none", "int8", "int4"],
                   help="weight storage (default: as the source: a 4-bit GGUF int4, an 8-bit "
                        "GGUF int8, float sources none); GGUF blocks are transcoded exactly")
    p.add_argument("--mode", choices=["exact", "fast"], default="fast",
                   help="for block weights: exact (float activations, the reference's math) or "
                        "fast (int8 activations per block) (default: fast)")
    p.add_argument("--accept-drift", action="store_true",
                   help="publish even when verification misses its thresholds (the manifest "
                        "records the figures)")
    p.add_argument("--steps", type=int, default=32, help="greedy steps to verify (default: 32)")
    p.add_argument("--max-memory-mb", type=int,
                   help="memory the export may use (default: half of this machine's RAM, or 90 %% "
                        "of what is available if less); an export that cannot fit is refused at "
                        "the start")
    p.add_argument("--prefer", choices=["size", "speed"], default="size",
                   help="for 5-bit GGUF blocks (Q5_0, Q5_1, Q5_K) in fast mode: size stores them "
                        "at their width as a 4-bit and a 2-bit product; speed in 8-bit storage "
                        "(Gemma 3 270M: 1.08x vs 1.18x the GGUF, decode 48 vs 55 tok/s)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def summary(console: Console, res: object) -> None:
    from edgelite_export.build import Result, export_bytes

    assert isinstance(res, Result)
    m = res.manifest
    t = Table(title=f"{m.name} -> {res.out} ({m.weights}, {m.compute})")
    for col in ("file", "MB", "export s"):
        t.add_column(col, justify="left" if col == "file" else "right")
    for r in res.rows:
        t.add_row(r["file"], f"{r['mb']:.1f}", f"{r['seconds']:.2f}")
    console.print(t)
    rep = res.report
    console.print(f"verified {rep.positions} positions: mean KL divergence {rep.kld:.2e}, top-1 "
                  f"agreement {rep.top1_confident:.2%} at {rep.confident_positions} confident "
                  f"positions ({rep.top1_agreement:.2%} at all), greedy {rep.greedy_prefix}/"
                  f"{rep.steps}"
                  f"{' [DRIFT ACCEPTED: ' + '; '.join(rep.problems) + ']' if rep.problems else ''}; "
                  f"{export_bytes(res.out) / 1e6:.1f} MB; {res.seconds:.0f} s; peak memory "
                  f"{res.peak_rss_bytes / 2**20:.0f} MiB; fingerprint {m.fingerprint}")


class Count(ProgressColumn):
    """done/total of a step that has a count; nothing while a step has none (reading the source)."""

    def render(self, task: Task) -> Text:
        return Text("" if task.total is None else f"{task.completed:.0f}/{task.total:.0f}")


def _run(args: argparse.Namespace, console: Console) -> object:
    from edgelite_export import build

    opts = build.Options(quantize=args.quantize, mode=args.mode, steps=args.steps,
                         accept_drift=args.accept_drift, force=args.force,
                         max_memory_mb=args.max_memory_mb, prefer=args.prefer)
    columns = (TextColumn("{task.description}"), BarColumn(), Count(), TimeElapsedColumn(),
               TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("reading the source", total=None)

        def progress(what: str, done: int, total: int) -> None:
            bar.update(task, description=what, completed=done, total=total)

        return build.run(args.source, args.out, opts, progress)


def upgrade(argv: list[str]) -> int:
    """`edgelite-export upgrade DIR`: the manifest of an older export gets its product table."""
    if len(argv) != 1:
        print("usage: edgelite-export upgrade DIR", file=sys.stderr)
        return 2
    try:
        from edgelite_export.products import upgrade as run
    except ImportError as exc:
        print(f"error: edgelite-export needs the PC-side packages ({exc.name} is missing)", file=sys.stderr)
        return 1
    try:
        count = run(Path(argv[0]))
    except EdgeliteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{argv[0]}: {count} products listed in its manifest (its files are unchanged)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["upgrade"]:
        return upgrade(argv[1:])
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # other libraries' advice would draw over the progress display
        warnings.simplefilter("ignore")
    console = Console(stderr=True)
    try:
        from edgelite_export import build
    except ImportError as exc:
        print(f"error: edgelite-export needs the PC-side packages ({exc.name} is missing): "
              f"pip install torch==2.13.0 'edgelite[export]'", file=sys.stderr)
        return 1
    try:
        res = _run(args, console)
    except EdgeliteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: nothing was written to {args.out}", file=sys.stderr)
        return 130
    assert isinstance(res, build.Result)
    if args.json:
        import json

        print(json.dumps({"out": str(res.out), "fingerprint": res.manifest.fingerprint,
                          "weights": res.manifest.weights, "compute": res.manifest.compute,
                          "bytes": build.export_bytes(res.out), "seconds": round(res.seconds, 2),
                          "peak_rss_bytes": res.peak_rss_bytes,
                          "verification": res.report.to_json(), "files": res.rows}))
    else:
        summary(Console(), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
