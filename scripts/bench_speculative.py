"""Speculative decoding over a 3-node pipeline: SmolLM2, decode speed with and without drafts,
over the demo's emulated Wi-Fi links and over loopback, in interleaved rounds (JSON on stdout).

    python scripts/bench_speculative.py [--rounds 3] [--tokens 128] [--models models/bench]
    python scripts/bench_speculative.py --ids [--tokens 64]   # greedy ids only, 20 prompts

Targets and drafts: the int4 fast export with prompt lookup (a grounded task: correct a given
~500-token passage with a few typos, returning it whole; and open chat); the int4 exact
export with the fast one as its draft model. Every reply is greedy; each speculating
reply's ids are compared with the same prompt's reply without speculation in the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from bench_local import edgelite_export  # noqa: E402

import edgelite  # noqa: E402
from edgelite import manifest as mf  # noqa: E402
from edgelite.cli.demo import DemoConfig, EmulatedCluster  # noqa: E402
from edgelite.cli.localnodes import TOKEN, start_node  # noqa: E402
from edgelite.config import ClientConfig, RuntimeConfig  # noqa: E402

SPLIT = [(0, 9), (10, 19), (20, 29)]
CHAT = ["Why is the sky blue?", "Write a short story about a robot who learns to paint.",
        "What should I pack for a week of hiking in the mountains?",
        "Explain how a bicycle stays upright."]


def grounded_prompts() -> list[str]:
    """Three ~500-token passages of the reference text, each with a few typos, to correct: a
    rewrite whose answer stays close to its input."""
    from edgelite_export.reference_text import TEXT

    words = TEXT.split()
    out = []
    for start in (0, 1200, 2400):
        passage = words[start:start + 330]
        for i in range(17, len(passage), 41):  # a typo every 41 words: two letters swapped
            w = passage[i]
            if len(w) > 3:
                passage[i] = w[0] + w[2] + w[1] + w[3:]
        out.append("Fix the spelling and grammar of the following text and return the whole "
                   "corrected text:\n\n" + " ".join(passage))
    return out


async def reply(llm, prompt: str, tokens: int, mode: str) -> dict:
    r = llm.chat([{"role": "user", "content": prompt}], max_tokens=tokens, temperature=0.0,
                 speculate=mode, reuse=False)
    await r.collect()
    st = r.stats
    return {"tok_s": st.decode_tok_s, "ids": st.token_ids, "acceptance": st.acceptance,
            "tokens_per_step": st.tokens_per_step}


async def compare(llm, prompts: list[str], modes: list[str], rounds: int, tokens: int) -> dict:
    """Each prompt in every mode, the modes' order turned around each round; speeds per mode,
    ratios against off per (round, prompt) and each prompt's median ratio, and whether the ids
    equal off's."""
    speeds: dict[str, list[float]] = {m: [] for m in modes}
    ratios: dict[str, list[float]] = {m: [] for m in modes if m != "off"}
    same: dict[str, list[bool]] = {m: [] for m in modes if m != "off"}
    extra: dict[str, list[tuple[float, float]]] = {m: [] for m in modes if m != "off"}
    await reply(llm, prompts[0], 8, "off")  # warm up
    for r in range(rounds):
        for prompt in prompts:
            got = {}
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                got[mode] = await reply(llm, prompt, tokens, mode)
                speeds[mode].append(got[mode]["tok_s"])
            for mode in ratios:
                ratios[mode].append(got[mode]["tok_s"] / got["off"]["tok_s"])
                same[mode].append(got[mode]["ids"] == got["off"]["ids"])
                extra[mode].append((got[mode]["acceptance"], got[mode]["tokens_per_step"]))
    out = {"decode_tok_s_median": {m: round(statistics.median(v), 2) for m, v in speeds.items()}}
    for mode, rs in ratios.items():
        # each prompt's median over the rounds (noise of one reply: the draft model's
        # replies that drafted nothing measured 0.987-1.003 of off), and the lowest of them
        by_prompt = [statistics.median(rs[i::len(prompts)]) for i in range(len(prompts))]
        out[mode] = {"speed_vs_off_median": round(statistics.median(rs), 3),
                     "speed_vs_off": [round(x, 3) for x in rs],
                     "speed_vs_off_by_prompt": [round(x, 3) for x in by_prompt],
                     "speed_vs_off_lowest_prompt": round(min(by_prompt), 3),
                     "ids_equal_off": f"{sum(same[mode])}/{len(same[mode])}",
                     "acceptance_median": round(statistics.median(a for a, _ in extra[mode]), 3),
                     "tokens_per_step_median": round(statistics.median(t for _, t in extra[mode]), 2)}
    return out


async def run_on(addrs, routes, models: dict[str, Path], args) -> dict:
    client = ClientConfig()
    runtime = RuntimeConfig(threads=1, allow_spinning=False)
    out = {}
    async with edgelite.connect(models["fast"], addrs, TOKEN, split=SPLIT, routes=routes,
                                runtime=runtime, client=client) as llm:
        out["lookup_grounded"] = await compare(llm, grounded_prompts(), ["off", "lookup"],
                                               args.rounds, args.tokens)
        out["lookup_chat"] = await compare(llm, CHAT, ["off", "lookup"], args.rounds, args.tokens)
    if not args.skip_draft:
        async with edgelite.connect(models["exact"], addrs, TOKEN, split=SPLIT, routes=routes,
                                    runtime=runtime, client=client, draft=models["fast"]) as llm:
            out["draft_chat"] = await compare(llm, CHAT, ["off", "draft"], args.rounds, args.tokens)
    return out


BOTH_MODELS_MB = 260.0  # a phone's node holding a third of both SmolLM2 exports, and a chunk

MORE = ["Write a haiku about the sea.", "Explain what a hash table is in two sentences.",
        "List three uses of a paperclip.", "What is the capital of France, and why is it famous?",
        "Give me a recipe for a simple tomato soup.", "How do phones connect to Wi-Fi?",
        "Summarise the plot of Romeo and Juliet.", "What is 17 times 23? Show the steps.",
        "Describe a cat to someone who has never seen one.", "Repeat after me: the cat sat on "
        "the mat, the cat sat on the mat, the cat sat on the mat.",
        "Translate 'good morning, how are you' into French and Spanish.",
        "Name the planets of the solar system in order.", "Write a limerick about a programmer."]


async def ids_check(models: dict[str, Path], tokens: int, root: Path) -> dict:
    """Greedy ids with and without speculation (prompt lookup; and the draft model for the
    exact export), 20 prompts, locally and on 3 nodes."""
    prompts = (CHAT + grounded_prompts() + MORE)[:20]
    runtime = RuntimeConfig(threads=1, allow_spinning=False)
    out: dict = {"prompts": len(prompts), "tokens": tokens}
    nodes = [start_node(root / f"ids{i}", extra=("--no-spin",)) for i in range(3)]
    try:
        for where, kw in (("local", {}), ("3 nodes", {"nodes": [n.addr for n in nodes],
                                                       "token": TOKEN, "split": SPLIT})):
            for target, mode, draft in (("fast", "lookup", None), ("exact", "draft", "fast")):
                async with edgelite.connect(models[target], runtime=runtime,
                                            draft=models[draft] if draft else None, **kw) as llm:
                    same = 0
                    for p in prompts:
                        off = await reply(llm, p, tokens, "off")
                        spec = await reply(llm, p, tokens, mode)
                        same += off["ids"] == spec["ids"]
                out[f"{where}: {target} with {mode}"] = f"{same}/{len(prompts)}"
    finally:
        for n in nodes:
            n.kill()
    return out


async def main(args: argparse.Namespace) -> dict:
    models = {"fast": edgelite_export(args.models / "smol-int4-fast"),
              "exact": edgelite_export(args.models / "smol-int4-exact", "--mode", "exact")}
    result: dict = {"model": "SmolLM2-135M", "split": "3 nodes: layers 0-9, 10-19, 20-29",
                    "rounds": args.rounds, "tokens": args.tokens,
                    "lookup_target": "int4 fast", "draft": "int4 fast drafting for int4 exact"}
    with tempfile.TemporaryDirectory() as tmp:
        if args.ids:
            result["ids_equal_without_speculation"] = await ids_check(models, args.tokens, Path(tmp))
            return result
        if "wifi" in args.links:
            # (the phones hold the fast export, then the exact one beside it: room for both)
            demo = DemoConfig(node_memory_mb=BOTH_MODELS_MB)
            async with EmulatedCluster(mf.load(models["fast"]), Path(tmp) / "wifi", demo,
                                       seed_files=True) as cluster:
                result["wifi"] = await run_on(cluster.addrs, cluster.routes, models, args)
            result["wifi_links"] = "the demo's: client to phones 5/10/15 ms +-1-2, phone to phone 8 ms"
        if "loopback" in args.links:
            nodes = [start_node(Path(tmp) / f"lo{i}", extra=("--no-spin",)) for i in range(3)]
            try:
                addrs = [edgelite.NodeAddr.parse(n.addr) for n in nodes]
                result["loopback"] = await run_on(addrs, None, models, args)
            finally:
                for n in nodes:
                    n.kill()
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--models", type=Path, default=ROOT / "models" / "bench")
    ap.add_argument("--links", default="wifi,loopback")
    ap.add_argument("--skip-draft", action="store_true")
    ap.add_argument("--ids", action="store_true",
                    help="only compare greedy ids with and without speculation: 20 prompts, "
                         "locally and on 3 nodes")
    print(json.dumps(asyncio.run(main(ap.parse_args())), indent=1))
