"""The same request gives the same answer: for 10 prompts and 64 tokens, greedy and sampled
(temperature 0.8, a seed), on the fast and the exact SmolLM2 exports, the token ids of one
local run with the KV store off are compared with those of

- local runs with the store on: the first (a miss, which stores the prompt's KV) and the
  second (a hit: the prompt's KV read back);
- 2 and 3 node processes with 3 different splits;
- `edgelite serve --http`: the first and a repeated request (its KV store on), 4 requests of
  one prompt at once and 4 of different prompts at once (over HTTP the reply's text is
  compared, the ids are not on the wire, and apart its log probabilities, bit for bit);
- failover: a node killed (-9) after 20 tokens of the reply, on a 3-node split.

Prints one JSON object: per export and sampling, per check, how many prompts gave identical
output, and `identical` overall.

    python scripts/check_determinism.py [--models /work/cache/bench] [--prompts 10] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

PROMPTS = ["Why is the sky blue?", "Write a haiku about the sea.",
           "Explain what a hash table is in two sentences.", "List three uses of a paperclip.",
           "What is the capital of France, and why is it famous?",
           "Give me a recipe for a simple tomato soup.", "How do phones connect to Wi-Fi?",
           "Summarise the plot of Romeo and Juliet.", "What is 17 times 23? Show the steps.",
           "Describe a cat to someone who has never seen one."]
SPLITS = {"2 nodes 0-14,15-29": [(0, 14), (15, 29)], "2 nodes 0-4,5-29": [(0, 4), (5, 29)],
          "3 nodes 0-9,10-19,20-29": [(0, 9), (10, 19), (20, 29)]}
INVARIANT = True  # --no-invariant: every part computes as before issue 41 (to compare)
SAMPLINGS = {"greedy": {"temperature": 0.0}, "t0.8_seed7": {"temperature": 0.8, "seed": 7}}
KILL_AFTER = 20  # tokens of the reply before a node is killed


def export(models: Path, name: str, *flags: str) -> Path:
    out = models / name
    if not (out / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "edgelite_export", "smollm2-135m", "--out", str(out),
                        *flags], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


async def _reply(llm: Any, prompt: str, tokens: int, sampling: dict[str, Any],
                 fault: Any = None) -> tuple[list[int], str, int]:
    """(ids, text, prompt tokens reused from the KV store); `fault()` after KILL_AFTER ids."""
    reply = llm.chat([{"role": "user", "content": prompt}], max_tokens=tokens, **sampling)
    ids: list[int] = []
    async for piece in reply:
        if piece.token_id is not None:
            ids.append(piece.token_id)
            if fault is not None and len(ids) == KILL_AFTER:
                fault()
    return ids, reply.text, reply.stats.reused_tokens


def _tally(name: str, want: list[list[int]], got: list[list[int]], **more: Any) -> dict[str, Any]:
    same = sum(a == b for a, b in zip(want, got, strict=True))
    return {"check": name, "identical": same, "of": len(want), **more}


async def local_checks(model: Path, prompts: list[str], tokens: int,
                       sampling: dict[str, Any]) -> tuple[list[list[int]], list[str], list[dict]]:
    import edgelite
    from edgelite.config import KVStoreConfig, RuntimeConfig

    off = RuntimeConfig(threads=1, kv_store=KVStoreConfig(budget_bytes=0), invariant=INVARIANT)
    async with edgelite.connect(model, runtime=off) as llm:
        ref = [await _reply(llm, p, tokens, sampling) for p in prompts]
    with tempfile.TemporaryDirectory() as store:
        on = RuntimeConfig(threads=1, kv_store=KVStoreConfig(dir=store), invariant=INVARIANT)
        async with edgelite.connect(model, runtime=on) as llm:
            miss = [await _reply(llm, p, tokens, sampling) for p in prompts]
            hit = [await _reply(llm, p, tokens, sampling) for p in prompts]
    want = [r[0] for r in ref]
    return want, [r[1] for r in ref], [
        _tally("store miss", want, [r[0] for r in miss]),
        _tally("store hit", want, [r[0] for r in hit],
               reused_tokens=[r[2] for r in hit])]


async def node_checks(model: Path, prompts: list[str], tokens: int, sampling: dict[str, Any],
                      want: list[list[int]], root: Path) -> list[dict]:
    import edgelite
    from edgelite.cli.localnodes import TOKEN, start_node
    from edgelite.config import RuntimeConfig

    out = []
    flags = () if INVARIANT else ("--no-invariant",)
    nodes = [start_node(root / f"node{i}", extra=flags) for i in range(3)]
    try:
        for label, split in SPLITS.items():
            async with edgelite.connect(model, nodes=[n.addr for n in nodes[:len(split)]],
                                        token=TOKEN, split=split,
                                        runtime=RuntimeConfig(threads=1, invariant=INVARIANT)) as llm:
                got = [(await _reply(llm, p, tokens, sampling))[0] for p in prompts]
            out.append(_tally(label, want, got))
    finally:
        for n in nodes:
            n.kill()
    got, recovered = [], 0
    for i, p in enumerate(prompts):  # a node killed mid-answer, for each prompt
        nodes = [start_node(root / f"fail{i}-{j}", extra=flags) for j in range(3)]
        try:
            async with edgelite.connect(model, nodes=[n.addr for n in nodes], token=TOKEN,
                                        split=SPLITS["3 nodes 0-9,10-19,20-29"],
                                        runtime=RuntimeConfig(threads=1, invariant=INVARIANT)) as llm:
                got.append((await _reply(llm, p, tokens, sampling, nodes[1].kill))[0])
                recovered += len(llm.recoveries)
        finally:
            for n in nodes:
                n.kill()
    out.append(_tally(f"failover (kill -9 after {KILL_AFTER} tokens)", want, got,
                      recoveries=recovered))
    return out


def _post(base: str, prompt: str, tokens: int, sampling: dict[str, Any]) -> tuple[str, list]:
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": tokens, "logprobs": True, **sampling}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        choice = json.loads(r.read())["choices"][0]
    lp = [(c["token"], c["logprob"]) for c in choice["logprobs"]["content"]]
    return choice["message"]["content"], lp


def http_checks(model: Path, prompts: list[str], tokens: int, sampling: dict[str, Any],
                texts: list[str], root: Path) -> list[dict]:
    from edgelite.cli.localnodes import start_serve, wait_healthy

    env_home = root / "serve-home"
    os.environ["EDGELITE_HOME"] = str(env_home)  # (the serve process's KV store, its own)
    with (root / "serve.log").open("w") as log:
        proc, found = start_serve(["--model", str(model), "--http", "127.0.0.1:0", "--no-native",
                                   "--threads", "1", *([] if INVARIANT else ["--no-invariant"])],
                                  log, r"listening on (http://[\d.]+:\d+)/v1")
    base = found.group(1)
    try:
        wait_healthy(base)
        first = [_post(base, p, tokens, sampling) for p in prompts]
        again = [_post(base, p, tokens, sampling) for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            same_prompt = list(pool.map(lambda _: _post(base, prompts[0], tokens, sampling),
                                        range(4)))
            different = list(pool.map(lambda p: _post(base, p, tokens, sampling), prompts[:4]))
    finally:
        proc.kill()
        proc.wait(10)
    def same(a: list[tuple[str, list]], b: list[tuple[str, list]]) -> dict[str, int]:
        """Texts equal (the ids are not on the wire), and log probabilities equal bit for bit."""
        return {"identical": sum(x[0] == y[0] for x, y in zip(a, b, strict=True)),
                "logprobs_identical": sum(x == y for x, y in zip(a, b, strict=True)), "of": len(a)}

    return [
        {"check": "http first == local (text)", "of": len(prompts),
         "identical": sum(f[0] == t for f, t in zip(first, texts, strict=True))},
        {"check": "http repeated == first", **same(again, first)},
        {"check": "http 4 at once, one prompt", **same(same_prompt, [first[0]] * 4)},
        {"check": "http 4 at once, different prompts", **same(different, first[:len(different)])}]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=Path("models/bench"))
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--exports", default="fast,exact")
    ap.add_argument("--no-invariant", action="store_true",
                    help="compute as before issue 41 (one-row decode kernels, batches)")
    args = ap.parse_args()
    global INVARIANT
    INVARIANT = not args.no_invariant
    args.models.mkdir(parents=True, exist_ok=True)
    models = {"fast": lambda: export(args.models, "smol-int4-fast"),
              "exact": lambda: export(args.models, "smol-int4-exact", "--mode", "exact")}
    prompts = PROMPTS[:args.prompts]
    result: dict[str, Any] = {"prompts": len(prompts), "tokens": args.tokens,
                              "invariant": INVARIANT, "exports": {}}
    t0 = time.perf_counter()
    for name in args.exports.split(","):
        model = models[name]()
        for label, sampling in SAMPLINGS.items():
            with tempfile.TemporaryDirectory() as tmp:
                root = Path(tmp)
                want, texts, checks = asyncio.run(local_checks(model, prompts, args.tokens, sampling))
                checks += asyncio.run(node_checks(model, prompts, args.tokens, sampling, want, root))
                checks += http_checks(model, prompts, args.tokens, sampling, texts, root)
            result["exports"].setdefault(name, {})[label] = checks
            print(json.dumps({name: {label: checks}}), file=sys.stderr, flush=True)
    result["identical"] = all(c["identical"] == c["of"] for e in result["exports"].values()
                              for checks in e.values() for c in checks)
    result["seconds"] = round(time.perf_counter() - t0)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
