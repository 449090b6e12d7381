"""What `response_format: json_object` costs per token: SmolLM2 int4 fast, 1 thread, locally,
the same prompts with and without the JSON constraint in interleaved rounds (greedy, 128
tokens at most). Prints one JSON object: decode tok/s each way, the ms a token the mask
adds, and how many replies were whole JSON objects.

    python scripts/bench_json.py [--models /work/cache/bench] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_local import edgelite_export

import edgelite
from edgelite.config import KVStoreConfig, RuntimeConfig

PROMPTS = ["Describe a fictional person as JSON with name, age and hobbies.",
           "Give the three largest planets and their diameters as a JSON object.",
           "Return a JSON object with a recipe: title, ingredients (a list) and steps.",
           "List three fruits and their colours."]


async def main(args: argparse.Namespace) -> dict:
    model = edgelite_export(args.models / "smol-int4-fast")
    runtime = RuntimeConfig(threads=1, kv_store=KVStoreConfig(budget_bytes=0))
    speeds: dict[str, list[float]] = {"text": [], "json_object": []}
    whole = 0
    async with edgelite.connect(model, runtime=runtime) as llm:
        for r in range(args.rounds):
            for prompt in PROMPTS:
                for fmt in (("text", "json_object") if r % 2 == 0 else ("json_object", "text")):
                    reply = llm.chat([{"role": "user", "content": prompt}], max_tokens=128,
                                     temperature=0.0, response_format=fmt, reuse=False)
                    await reply.collect()
                    speeds[fmt].append(reply.stats.decode_tok_s)
                    if fmt == "json_object":
                        try:
                            whole += isinstance(json.loads(reply.text), dict)
                        except ValueError:
                            pass
    med = {k: round(statistics.median(v), 2) for k, v in speeds.items()}
    return {"model": "SmolLM2-135M int4 fast", "threads": 1, "rounds": args.rounds,
            "decode_tok_s_median": med,
            "mask_ms_per_token": round(1e3 / med["json_object"] - 1e3 / med["text"], 3),
            "ratio": round(med["json_object"] / med["text"], 3),
            "whole_json_objects": f"{whole}/{len(speeds['json_object'])}"}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=Path("models/bench"))
    ap.add_argument("--rounds", type=int, default=3)
    print(json.dumps(asyncio.run(main(ap.parse_args())), indent=1))
