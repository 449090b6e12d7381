"""Several users at once through `edgelite serve --http` on 3 node processes: replies one after
another against 4 and 8 at once, with the row-invariant default and with `--no-invariant`
(SmolLM2 int4 fast, a 0-9, 10-19, 20-29 split on loopback, 1 thread a process).

Each mode runs on fresh node and serve processes; the modes take turns by round (the order
alternating). For each: 8 different greedy prompts one after another (`/v1/completions`, log
probabilities asked for), the first 4 of them at once, all 8 at once, and 4 seeded sampled
replies alone and at once. A reply "equal" has the same text, tokens and log probabilities
(bit for bit, as JSON floats) as the same request alone. Aggregate tokens/s of k at once is
compared with the same k one after another. The gateway's batch sizes come from /metrics.
Prints one JSON object with medians and ratios.

    python scripts/bench_batch.py [--models models/bench] [--rounds 2] [--tokens 64] [--set NAME=VALUE]
                                  [--link DELAY_MS,JITTER_MS,MBPS]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from edgelite.cli.localnodes import TOKEN, start_node, start_serve, stop_serve, wait_healthy

# prompts whose greedy replies run the whole 64 tokens (none ends at EOS): k at once is k
# streams from the first token to the last, not the longest reply's tail
PROMPTS = ("The history of the city begins", "Explain how a rainbow forms", "List five uses of a phone",
           "Describe a walk in the forest", "Write a letter to a friend",
           "Once upon a time in a small village", "The most important thing about science is",
           "Explain why the sky is blue")
KEY = "t-bench"
MODEL_ID = [""]  # what /v1/models names it


def start(model: Path, addrs: list[str], tmp: Path, invariant: bool, settings: tuple[str, ...] = (),
          routes: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    users = tmp / "users.json"
    users.write_text(json.dumps({"users": [{"name": "bench", "token": KEY, "tier": 0}]}))
    with (tmp / "serve.log").open("w") as log:
        proc, found = start_serve(
            ["--model", str(model), "--nodes", ",".join(addrs), *routes, "--split",
             "0-9,10-19,20-29", "--token", TOKEN, "--users", str(users), "--http", "127.0.0.1:0",
             "--no-native", "--threads", "1", "--no-spin", "--set", "max_requests_per_user=16",
             *(() if invariant else ("--no-invariant",)), *(x for kv in settings for x in ("--set", kv))],
            log, r"listening on (http://[\d.]+:\d+)/v1", timeout=120)
    base = found.group(1)
    if wait_healthy(base):
        models = urllib.request.Request(base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(models, timeout=5) as r:
            MODEL_ID[0] = json.loads(r.read())["data"][0]["id"]
        return proc, base
    proc.kill()
    raise RuntimeError("serve never became healthy: " + (tmp / "serve.log").read_text()[-2000:])


def post(base: str, prompt: str, tokens: int, temperature: float = 0.0, seed: int | None = None
         ) -> dict[str, Any]:
    body = {"model": MODEL_ID[0], "prompt": prompt, "max_tokens": tokens, "temperature": temperature,
            "logprobs": 1, **({} if seed is None else {"seed": seed})}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    choice = out["choices"][0]
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"],
            "logprobs": choice["logprobs"]["token_logprobs"], "n": out["usage"]["completion_tokens"]}


def metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines()
                                     if ln and not ln.startswith("#"))}


def at_once(base: str, asks: list[tuple[str, float, int | None]], tokens: int
            ) -> tuple[list[dict], float]:
    """The asks sent together; their replies and aggregate tokens/s."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(lambda a: post(base, a[0], tokens, a[1], a[2]), asks))
    return got, sum(g["n"] for g in got) / (time.perf_counter() - t0)


def one_after_another(base: str, asks: list[tuple[str, float, int | None]], tokens: int
                      ) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    got = [post(base, p, tokens, t, s) for p, t, s in asks]
    return got, sum(g["n"] for g in got) / (time.perf_counter() - t0)


def measure(model: Path, invariant: bool, tokens: int, settings: tuple[str, ...],
            link: dict | None, node_settings: tuple[str, ...] = ()) -> dict[str, Any]:
    from bench_scale import linked

    from edgelite import manifest as mf
    from edgelite.cli.demo import seed

    flags = ("--no-spin", *(() if invariant else ("--no-invariant",)),
             *(x for kv in node_settings for x in ("--set", kv)))
    with tempfile.TemporaryDirectory() as tmp:
        homes = [Path(tmp) / f"n{i}" for i in range(3)]
        for home in homes if link else ():  # (the weights on the nodes: not through the links)
            seed(mf.load(model), home)
        nodes = [start_node(home, threads=1, extra=flags) for home in homes]
        links, addrs, routes = (linked([x.port for x in nodes], link) if link is not None
                                else (None, [x.addr for x in nodes], []))
        proc = None
        try:
            proc, base = start(model, addrs, Path(tmp), invariant, settings, tuple(routes))
            post(base, "warm up", 8)
            out: dict[str, Any] = {}
            for n in (4, 8):
                asks = [(p, 0.0, None) for p in PROMPTS[:n]]
                alone, seq = one_after_another(base, asks, tokens)
                together, par = at_once(base, asks, tokens)
                out[f"{n}_one_after_another_tok_s"] = seq
                out[f"{n}_at_once_tok_s"] = par
                out[f"{n}_at_once_equal"] = together == alone
            sampled = [(p, 0.9, 1000 + i) for i, p in enumerate(PROMPTS[:4])]
            alone, _ = one_after_another(base, sampled, tokens)
            together, _ = at_once(base, sampled, tokens)
            out["sampled_4_at_once_equal"] = together == alone
            out["sampled_differ_from_greedy"] = [g["text"] for g in alone] != [
                post(base, p, tokens)["text"] for p in PROMPTS[:4]]
            mx = metrics(base)
            out["batch_size_max"] = mx.get('edgelite_batch_size{stat="max"}')
            return out
        finally:
            if proc is not None:
                stop_serve(proc)
            for nd in nodes:
                nd.kill()
            if links is not None:
                links.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=Path("models/bench"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--modes", default="on,off", help="on: invariant default; off: --no-invariant")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="gateway settings (edgelite serve --set)")
    ap.add_argument("--node-set", action="append", default=[], metavar="NAME=VALUE",
                    help="node settings (edgelite node --set)")
    ap.add_argument("--link", default="", help="DELAY_MS,JITTER_MS,MBPS: every link emulated so "
                    "(the userspace emulator; the weights put on the nodes first)")
    args = ap.parse_args()
    model = args.models / "smol-int4-fast"
    if not (model / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "edgelite_export", "smollm2-135m", "--out", str(model)],
                       check=True, stdout=subprocess.DEVNULL)
    link = None
    if args.link:
        delay, jitter, rate = (float(x) for x in args.link.split(","))
        link = {"delay_ms": delay, "jitter_ms": jitter, "rate_mbps": rate, "loss": 0.0}
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            runs[mode].append(measure(model, mode == "on", args.tokens, tuple(args.set), link,
                                      tuple(args.node_set)))
            print(json.dumps({mode: runs[mode][-1]}), file=sys.stderr)

    def med(mode: str, key: str) -> float:
        return round(statistics.median(x[key] for x in runs[mode]), 2)

    keys = ("4_one_after_another_tok_s", "4_at_once_tok_s", "8_one_after_another_tok_s", "8_at_once_tok_s")
    table = {mode: {k: med(mode, k) for k in keys} for mode in runs}
    result: dict[str, Any] = {
        "model": "SmolLM2-135M int4 fast, 3 nodes, serve --http", "tokens": args.tokens, "settings": args.set,
        "node_settings": args.node_set,
        "link": link,
        "rounds": args.rounds, "results": table,
        "speedup": {mode: {f"{n}_at_once_over_one_after_another": round(
            table[mode][f"{n}_at_once_tok_s"] / table[mode][f"{n}_one_after_another_tok_s"], 2)
            for n in (4, 8)} for mode in runs},
        "equal_to_alone": {mode: {k: all(x[k] for x in runs[mode]) for k in (
            "4_at_once_equal", "8_at_once_equal", "sampled_4_at_once_equal")} for mode in runs},
        "runs": runs}
    if {"on", "off"} <= set(runs):
        result["invariant_over_no_invariant_4_at_once"] = round(
            table["on"]["4_at_once_tok_s"] / table["off"]["4_at_once_tok_s"], 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
