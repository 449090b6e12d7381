"""Several users at once on 3 nodes: replies one after another against 4 and 8 at once, with the
row-invariant default and with `--no-invariant`, the same greedy prompts (SmolLM2 int4 fast, a
0-9, 10-19, 20-29 split on loopback, 1 thread a process).

Each mode runs on fresh node processes; the modes take turns by round (the order alternating).
For each: the 4 prompts' replies one after another (their aggregate tokens/s), the same 4 at
once, 8 at once (the 4 twice over), whether every reply's ids equal its one-after-another
reply's, and the nodes' batched steps (stats). Prints one JSON object with medians and ratios.

    python scripts/bench_batch.py [--models models/bench] [--rounds 2] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = ("The history of the city begins", "Write a short story about a robot",
           "Explain how a rainbow forms", "List five uses of a phone")


async def _measure(model: str, invariant: bool, tokens: int) -> dict:
    import edgelite
    from edgelite.cli.localnodes import TOKEN, start_node
    from edgelite.config import KVStoreConfig, RuntimeConfig

    runtime = RuntimeConfig(threads=1, invariant=invariant, kv_store=KVStoreConfig(budget_bytes=0))
    flags = ("--no-spin",) if invariant else ("--no-spin", "--no-invariant")
    with tempfile.TemporaryDirectory() as tmp:
        nodes = [start_node(Path(tmp) / f"n{i}", threads=1, extra=flags) for i in range(3)]
        try:
            async with edgelite.connect(model, runtime=runtime, nodes=[n.addr for n in nodes], token=TOKEN,
                                        split=[(0, 9), (10, 19), (20, 29)]) as llm:
                async def reply(text: str) -> list[int]:
                    r = llm.complete(text, max_tokens=tokens, temperature=0.0)
                    await r.collect()
                    return r.token_ids

                await reply("warm up")
                t0 = time.perf_counter()
                alone = [await reply(p) for p in PROMPTS]
                seq = sum(map(len, alone)) / (time.perf_counter() - t0)
                out: dict = {"one_after_another_tok_s": seq}
                for n in (4, 8):
                    t0 = time.perf_counter()
                    ids = await asyncio.gather(*(reply(PROMPTS[i % 4]) for i in range(n)))
                    out[f"{n}_at_once_tok_s"] = sum(map(len, ids)) / (time.perf_counter() - t0)
                    out[f"{n}_at_once_ids_equal"] = all(x == alone[i % 4] for i, x in enumerate(ids))
                stats = await llm.node_stats()
                out["batched_steps"] = sum(s.get("batched_steps", 0) for s in stats.values())
                out["batches"] = sum(s.get("batches", 0) for s in stats.values())
                return out
        finally:
            for n in nodes:
                n.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=Path("models/bench"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)  # model, on|off
    args = ap.parse_args()
    if args.measure:
        model, mode = args.measure
        print(json.dumps(asyncio.run(_measure(model, mode == "on", args.tokens))))
        return
    model = args.models / "smol-int4-fast"
    if not (model / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "edgelite_export", "smollm2-135m", "--out", str(model)],
                       check=True, stdout=subprocess.DEVNULL)
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for r in range(args.rounds):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            out = subprocess.run([sys.executable, __file__, "--measure", str(model), mode,
                                  "--tokens", str(args.tokens)], capture_output=True, text=True, check=True)
            runs[mode].append(json.loads(out.stdout.splitlines()[-1]))

    def med(mode: str, key: str) -> float:
        return round(statistics.median(x[key] for x in runs[mode]), 2)

    keys = ("one_after_another_tok_s", "4_at_once_tok_s", "8_at_once_tok_s")
    table = {mode: {k: med(mode, k) for k in keys} for mode in runs}
    print(json.dumps({
        "model": "SmolLM2-135M int4 fast, 3 nodes", "tokens": args.tokens, "rounds": args.rounds,
        "results": table,
        "speedup_invariant": {f"{n}_at_once_over_one_after_another": round(
            table["on"][f"{n}_at_once_tok_s"] / table["on"]["one_after_another_tok_s"], 2) for n in (4, 8)},
        "invariant_over_no_invariant_4_at_once": round(table["on"]["4_at_once_tok_s"]
                                                       / table["off"]["4_at_once_tok_s"], 3),
        "ids_equal": {mode: all(x["4_at_once_ids_equal"] and x["8_at_once_ids_equal"] for x in runs[mode])
                      for mode in runs},
        "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
