"""What `response_format` json_object and json_schema, and tool calls, cost per token: SmolLM2
int4 fast, 1 thread, locally, the same prompts as text, as a JSON object, under a small schema
and as a forced call of a tool with that schema, in interleaved rounds (greedy, 128 tokens at
most). Prints one JSON object: decode tok/s each way, the ms a token the mask adds, how many
replies were whole JSON objects (calls), and what an embedding of each prompt takes.

    python scripts/bench_json.py [--models /work/cache/bench] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_local import edgelite_export

import edgelite
from edgelite.config import KVStoreConfig, RuntimeConfig

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "items": {
              "type": "array", "items": {"type": "string"}}, "count": {"type": "integer"}},
          "required": ["name", "items", "count"]}
PROMPTS = ["Describe a fictional person as JSON with name, age and hobbies.",
           "Give the three largest planets and their diameters as a JSON object.",
           "Return a JSON object with a recipe: title, ingredients (a list) and steps.",
           "List three fruits and their colours."]


async def main(args: argparse.Namespace) -> dict:
    model = edgelite_export(args.models / "smol-int4-fast")
    runtime = RuntimeConfig(threads=1, kv_store=KVStoreConfig(budget_bytes=0))
    speeds: dict[str, list[float]] = {"text": [], "json_object": [], "json_schema": [],
                                      "tool_call": []}
    whole = {"json_object": 0, "json_schema": 0, "tool_call": 0}
    tools = json.dumps([{"type": "function", "function": {"name": "record", "parameters": SCHEMA}}])
    embed_s: list[float] = []
    embed_tokens = 0
    async with edgelite.connect(model, runtime=runtime) as llm:
        for r in range(args.rounds):
            for prompt in PROMPTS:
                fmts = ["text", "json_object", "json_schema", "tool_call"]
                for fmt in fmts if r % 2 == 0 else fmts[::-1]:
                    call = fmt == "tool_call"
                    reply = llm.chat([{"role": "user", "content": prompt}], max_tokens=128,
                                     temperature=0.0, response_format="text" if call else fmt,
                                     reuse=False, tools=tools if call else "", tool_choice=(
                                         "required" if call else "auto"),
                                     json_schema=json.dumps(SCHEMA) if fmt == "json_schema" else "")
                    await reply.collect()
                    speeds[fmt].append(reply.stats.decode_tok_s)
                    if call:
                        whole[fmt] += reply.stats.finish == "tool_calls"
                    elif fmt != "text":
                        try:
                            whole[fmt] += isinstance(json.loads(reply.text), dict)
                        except ValueError:
                            pass
                t0 = time.perf_counter()
                await llm.embed(prompt)
                embed_s.append(time.perf_counter() - t0)
                embed_tokens += len(llm.tokenizer.text_prompt(prompt))
    med = {k: round(statistics.median(v), 2) for k, v in speeds.items()}
    return {"model": "SmolLM2-135M int4 fast", "threads": 1, "rounds": args.rounds,
            "decode_tok_s_median": med,
            "mask_ms_per_token": {f: round(1e3 / med[f] - 1e3 / med["text"], 3)
                                  for f in ("json_object", "json_schema", "tool_call")},
            "ratio": {f: round(med[f] / med["text"], 3)
                      for f in ("json_object", "json_schema", "tool_call")},
            "whole_json_objects": {f: f"{n}/{len(speeds[f])}" for f, n in whole.items()},
            "embedding": {"prompts": len(embed_s), "median_ms": round(
                statistics.median(embed_s) * 1e3, 1), "tok_s": round(embed_tokens / sum(embed_s), 1)},
            "schema": SCHEMA}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=Path("models/bench"))
    ap.add_argument("--rounds", type=int, default=3)
    print(json.dumps(asyncio.run(main(ap.parse_args())), indent=1))
