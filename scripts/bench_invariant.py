"""What row-invariant attention (engine/passes/invariant.py, issue 41) costs: decode tok/s and time to
first token with it on and off, on the int4 fast SmolLM2 export, 1 thread.

Each measurement runs in a fresh process; on and off take turns round by round (the order
alternating). Measured on prose (the exporter's reference text, raw completion): decode tok/s
after a 20-token prompt (128 tokens), decode tok/s after a 1,000-token one (64 tokens), and
the time to the first token of a 400-token prompt; locally, and on 3 node processes (a 0-9,
10-19, 20-29 split, loopback; there also 4 replies at once, whose decode steps nodes batch
only when off). Prints one JSON object with the medians and the ratios on/off.

    python scripts/bench_invariant.py [--models /work/cache/bench] [--rounds 3]
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


def _prompt(model: str, n_tokens: int) -> list[int]:
    """The first n_tokens of the exporter's reference text (English prose: the model goes on
    writing rather than ending)."""
    from edgelite import manifest as mf
    from edgelite.reply.tokenizer import Tokenizer
    from edgelite_export.reference_text import TEXT

    return Tokenizer(mf.load(model)).encode(TEXT)[:n_tokens]


async def _measure(model: str, invariant: bool, where: str) -> dict[str, float]:
    import edgelite
    from edgelite.cli.localnodes import TOKEN, start_node
    from edgelite.config import KVStoreConfig, RuntimeConfig

    runtime = RuntimeConfig(threads=1, invariant=invariant, kv_store=KVStoreConfig(budget_bytes=0))
    nodes, kw = [], {}
    tmp = tempfile.TemporaryDirectory()
    if where == "3 nodes":
        flags = () if invariant else ("--no-invariant",)
        nodes = [start_node(Path(tmp.name) / f"n{i}", extra=flags) for i in range(3)]
        kw = {"nodes": [n.addr for n in nodes], "token": TOKEN,
              "split": [(0, 9), (10, 19), (20, 29)]}
    try:
        async with edgelite.connect(model, runtime=runtime, **kw) as llm:
            async def run(text: str | list[int], n: int) -> tuple[float, float]:
                reply = llm.complete(text, max_tokens=n, temperature=0.0)
                async for _ in reply:
                    pass
                return reply.stats.ttft_ms, reply.stats.decode_tok_s

            await run("warm up", 16)
            _, short = await run(_prompt(model, 20), 128)
            ttft, _ = await run(_prompt(model, 400), 1)
            _, long = await run(_prompt(model, 1000), 64)
            out = {"decode_tok_s": short, "decode_tok_s_at_1000": long, "ttft_ms_400": ttft}
            if where == "3 nodes":  # 4 replies at once: nodes batch their steps only when off
                text = _prompt(model, 20)
                t0 = time.perf_counter()
                replies = [llm.complete(text[i:], max_tokens=64, temperature=0.0) for i in range(4)]
                await asyncio.gather(*(r.collect() for r in replies))
                out["tok_s_4_at_once"] = (sum(len(r.stats.token_ids) for r in replies)
                                          / (time.perf_counter() - t0))
            return out
    finally:
        for n in nodes:
            n.kill()
        tmp.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=Path("models/bench"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--measure", nargs=3, help=argparse.SUPPRESS)  # model, on|off, where
    args = ap.parse_args()
    if args.measure:
        model, mode, where = args.measure
        print(json.dumps(asyncio.run(_measure(model, mode == "on", where))))
        return
    model = args.models / "smol-int4-fast"
    if not (model / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "edgelite_export", "smollm2-135m", "--out",
                        str(model)], check=True, stdout=subprocess.DEVNULL)
    runs: dict[str, list[dict[str, float]]] = {}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for where in ("local", "3 nodes"):
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                out = subprocess.run([sys.executable, __file__, "--measure", str(model), mode, where],
                                     capture_output=True, text=True, check=True)
                runs.setdefault(f"{where} {mode}", []).append(json.loads(out.stdout.splitlines()[-1]))
    table = {k: {m: round(statistics.median(x[m] for x in v), 2) for m in v[0]}
             for k, v in runs.items()}
    ratios = {f"{where} on/off {m}": round(table[f"{where} on"][m] / table[f"{where} off"][m], 3)
              for where in ("local", "3 nodes") for m in table[f"{where} on"]
              if table[f"{where} off"][m]}
    print(json.dumps({"model": "SmolLM2-135M int4 fast", "threads": 1, "rounds": args.rounds,
                      "results": table, "ratios": ratios,
                      "runs": {k: [{m: round(x[m], 2) for m in x} for x in v] for k, v in runs.items()},
                      "seconds": round(time.perf_counter() - t0)}, indent=1))


if __name__ == "__main__":
    main()
