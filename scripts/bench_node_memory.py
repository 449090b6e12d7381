"""Two exports of one model side by side: decode speed and the memory of a node holding them.

    python scripts/bench_node_memory.py MODEL_A MODEL_B [--rounds 3] [--tokens 64] [--code-a DIR]

For each export, in interleaved rounds: decode tok/s of `--tokens` greedy tokens locally
(`edgelite generate --json`, 1 thread), and the peak RSS of one node process that holds every
layer (`--split 0-(n-1)`, the client keeping the embedding and head) while it generates. Prints
one JSON object with medians and ratios (B over A). `--code-a DIR` runs model A with the
edgelite source tree in DIR (e.g. a worktree of an older commit: `git worktree add DIR REV`), so
that an old export runs on the engine of its day.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

PROMPT = "Once upon a time, in a small village by the sea,"


@contextlib.contextmanager
def code(tree: Path | None):
    """Processes started inside run edgelite from `tree` (None: this one): they start in it
    (`python -m` looks in the current folder first) with it on PYTHONPATH."""
    before, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    if tree is not None:
        os.environ["PYTHONPATH"] = str(tree.resolve())
        os.chdir(tree)
    try:
        yield
    finally:
        os.chdir(cwd)
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def generate(model: Path, tokens: int, *extra: str) -> dict:
    res = subprocess.run([sys.executable, "-m", "edgelite", "generate", "--model", str(model),
                          "--max-tokens", str(tokens), "--raw", "--json", "--threads", "1", *extra,
                          PROMPT], capture_output=True, text=True, check=True)
    return json.loads(res.stdout)


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def node_run(model: Path, tokens: int) -> float:
    """The peak RSS (MiB) of a fresh node process that held every layer through a reply."""
    from edgelite import manifest as mf
    from edgelite.cli.localnodes import TOKEN, start_node

    n = mf.load(model).num_layers
    node = start_node(Path(tempfile.mkdtemp()), threads=1, kv_budget_mb=512)
    try:
        generate(model, tokens, "--nodes", node.addr, "--split", f"0-{n - 1}", "--token", TOKEN)
        return peak_rss_mib(node.proc.pid)
    finally:
        node.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", type=Path, nargs=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--code-a", type=Path, default=None, help="edgelite source tree for model A")
    args = ap.parse_args()
    runs: dict[str, dict[str, list[float]]] = {str(m): {"tok_s": [], "node_rss_mib": []} for m in args.models}
    for _ in range(args.rounds):
        for m, tree in zip(args.models, (args.code_a, None), strict=True):
            with code(tree):
                runs[str(m)]["tok_s"].append(generate(m, args.tokens)["decode_tok_s"])
                runs[str(m)]["node_rss_mib"].append(round(node_run(m, args.tokens), 1))
    med = {m: {k: statistics.median(v) for k, v in r.items()} for m, r in runs.items()}
    a, b = (str(m) for m in args.models)
    size = {str(m): sum(p.stat().st_size for p in m.iterdir()) for m in args.models}
    print(json.dumps({"code_a": str(args.code_a or "this tree"), "medians": med, "runs": runs, "bytes": size,
                      "ratio_b_over_a": {k: round(med[b][k] / med[a][k], 3) for k in med[a]}},
                     indent=1))


if __name__ == "__main__":
    main()
