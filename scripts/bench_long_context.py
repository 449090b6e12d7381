"""Long prompts end to end (issue 40): an 8,000-token prompt locally and on 3 node processes
(each node's peak RSS against what it held loaded + its KV capacity for 8,192 positions + 64
MiB), and `serve --http` answering a 6,000-token prompt and refusing a 9,000-token one at
once. JSON on stdout.

    python scripts/bench_long_context.py [MODEL]   (default: models/bench/smol-int4-fast)
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import edgelite
from edgelite import manifest as mf
from edgelite.cli.localnodes import TOKEN, start_node, start_serve, wait_healthy
from edgelite.config import RuntimeConfig
from edgelite.reply.tokenizer import Tokenizer

ROOT = Path(__file__).parent.parent
MODEL = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "models" / "bench" / "smol-int4-fast")
SPLIT = [(0, 9), (10, 19), (20, 29)]


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    return 0.0


def prompt(base: list[int], n: int) -> list[int]:
    return (base * (n // len(base) + 1))[:n]


async def local(base: list[int]) -> dict:
    async with edgelite.connect(MODEL, runtime=RuntimeConfig(threads=2)) as llm:
        t = time.time()
        r = llm.complete(prompt(base, 8000), max_tokens=16, reuse=False)
        await r.collect()
        return {"seconds": round(time.time() - t, 1), "tokens": len(r.token_ids),
                "finish": r.stats.finish}


async def on_nodes(m: mf.Manifest, base: list[int]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        nodes = [start_node(Path(tmp) / f"n{i}", kv_budget_mb=512) for i in range(3)]
        try:
            async with edgelite.connect(MODEL, [n.addr for n in nodes], TOKEN, split=SPLIT,
                                        runtime=RuntimeConfig(threads=1)) as llm:
                loaded = [rss_mib(n.proc.pid) for n in nodes]
                t = time.time()
                r = llm.complete(prompt(base, 8000), max_tokens=16, reuse=False)
                await r.collect()
                peak = [rss_mib(n.proc.pid, "VmHWM") for n in nodes]
        finally:
            for n in nodes:
                n.kill()
    # 10 layers a node, of the KV dtype nodes hold by default for this export
    kv = m.kv_bytes(0, 9, 8192, m.kv_dtype(RuntimeConfig.kv_dtype, invariant=True)) / 2**20
    return {"seconds": round(time.time() - t, 1), "tokens": len(r.token_ids),
            "node_rss_loaded_mib": [round(x) for x in loaded],
            "node_peak_mib": [round(x) for x in peak], "kv_capacity_mib": round(kv, 1),
            "within": all(p <= lo + kv + 64 for p, lo in zip(peak, loaded, strict=True))}


def served(tok: Tokenizer, base: list[int]) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        log = (Path(tmp) / "serve.log").open("w")
        proc, found = start_serve(["--model", MODEL, "--http", "127.0.0.1:0", "--no-native",
                                   "--threads", "2"], log, r"listening on (http://[\d.]+:\d+)/v1",
                                  timeout=120)
        url = found.group(1)
        try:
            wait_healthy(url)
            for n in (6000, 9000):
                body = json.dumps({"model": Path(MODEL).name, "prompt": tok.decode(prompt(base, n)),
                                   "max_tokens": 8}).encode()
                req = urllib.request.Request(url + "/v1/completions", body,
                                             {"Content-Type": "application/json"})
                t = time.time()
                try:
                    with urllib.request.urlopen(req, timeout=600) as r:
                        got = {"status": r.status, "usage": json.loads(r.read())["usage"]}
                except urllib.error.HTTPError as e:
                    got = {"status": e.code, "error": json.loads(e.read())["error"]["message"]}
                out[f"serve_{n}"] = {**got, "seconds": round(time.time() - t, 2)}
        finally:
            proc.kill()
    return out


def main() -> dict:
    from edgelite_export.reference_text import TEXT

    m = mf.load(MODEL)
    tok = Tokenizer(m)
    base = tok.text_prompt(TEXT)
    return {"model": MODEL, "local_8000": asyncio.run(local(base)),
            "nodes_8000": asyncio.run(on_nodes(m, base)), **served(tok, base)}


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
