"""edgelite-export SOURCE --out DIR"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from edgelite.errors import EdgeliteError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="edgelite-export",
        description="Cut a Hugging Face LLM into verified per-layer ONNX files + manifest.json.")
    p.add_argument("source", help="local HF folder, .gguf file, hub id (org/name) or an alias "
                                  "such as smollm2-135m")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--quantize", choices=["int8"], help="8-bit weight-only layers and head")
    p.add_argument("--steps", type=int, default=32, help="greedy decode steps to verify")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def summary(console: Console, res: object) -> None:
    from edgelite_export.build import Result

    assert isinstance(res, Result)
    t = Table(title=f"{res.manifest.name} -> {res.out}")
    for col in ("file", "MB", "export s", "max rel diff"):
        t.add_column(col, justify="left" if col == "file" else "right")
    for r in res.rows:
        t.add_row(r["file"], f"{r['mb']:.1f}", f"{r['seconds']:.2f}", f"{r['diff']:.1e}")
    console.print(t)
    rep = res.report
    console.print(f"verified {rep.steps} greedy steps: max logit diff {rep.max_logit_diff:.2e}, "
                  f"tokens agree {rep.token_agreement:.0%}"
                  + (f" [{res.manifest.quantization['method']}]" if res.manifest.quantization else "")
                  + f"; fingerprint {res.manifest.fingerprint}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    console = Console(stderr=args.json)
    from edgelite_export import build

    opts = build.Options(quantize=args.quantize, steps=args.steps, force=args.force)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                      "{task.total}"), TimeElapsedColumn(), console=console,
                      transient=True) as bar:
            task = bar.add_task("loading model", total=None)

            def progress(what: str, done: int, total: int) -> None:
                bar.update(task, description=f"export {what}", completed=done, total=total)

            res = build.run(args.source, args.out, opts, progress)
    except EdgeliteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        import json

        print(json.dumps({"out": str(res.out), "fingerprint": res.manifest.fingerprint,
                          "verification": res.report.to_json(), "files": res.rows}))
    else:
        summary(console, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
