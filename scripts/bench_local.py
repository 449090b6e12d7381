"""SmolLM2-135M: transformers vs the ONNX chain (1 and 2 threads, fp32 and int8), one process.

Configurations are measured alternately, round by round, so drift hits all of them alike.
Prints one JSON object. Usage: python scripts/bench_local.py [--rounds 3] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from edgelite import manifest as mf
from edgelite.config import RuntimeConfig
from edgelite.engine.runtime import LocalChain
from edgelite.engine.tokenizer import Tokenizer

PROMPT = "Explain briefly how phones on one Wi-Fi network can run one model together."


def ensure(out: Path, quant: str | None) -> Path:
    if not (out / "manifest.json").is_file():
        from edgelite_export import build

        build.run("smollm2-135m", out, build.Options(quantize=quant))
    return out


def onnx_run(chain: LocalChain, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
    kv = chain.layers.new_cache()
    t0 = time.perf_counter()
    logits, kv = chain.forward(np.array([prompt]), kv)
    prefill = time.perf_counter() - t0
    toks = [int(logits[0].argmax())]
    t1 = time.perf_counter()
    for _ in range(n - 1):
        logits, kv = chain.forward(np.array([[toks[-1]]]), kv)
        toks.append(int(logits[0].argmax()))
    return prefill * 1e3, (n - 1) / (time.perf_counter() - t1), toks


def hf_run(model, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
    import torch

    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        prefill = time.perf_counter() - t0
        toks, past = [int(out.logits[0, -1].argmax())], out.past_key_values
        t1 = time.perf_counter()
        for _ in range(n - 1):
            out = model(input_ids=torch.tensor([[toks[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            toks.append(int(out.logits[0, -1].argmax()))
    return prefill * 1e3, (n - 1) / (time.perf_counter() - t1), toks


def agreement(a: list[int], ref: list[int]) -> float:
    return sum(x == y for x, y in zip(a, ref, strict=True)) / len(ref)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--models", type=Path, default=Path("models"))
    args = ap.parse_args()
    import torch

    from edgelite_export import source

    torch.set_num_threads(1)
    fp32 = mf.load(ensure(args.models / "smollm2-135m", None))
    int8 = mf.load(ensure(args.models / "smollm2-135m-int8", "int8"))
    prompt = Tokenizer(fp32).chat_prompt([{"role": "user", "content": PROMPT}])
    hf, _ = source.load(source.resolve("smollm2-135m"))
    chains = {f"onnx_{q}_{t}t": LocalChain(m, RuntimeConfig(threads=t))
              for q, m in (("fp32", fp32), ("int8", int8)) for t in (1, 2)}
    runs = {"transformers_1t": lambda: hf_run(hf, prompt, args.tokens),
            **{name: (lambda c=c: onnx_run(c, prompt, args.tokens)) for name, c in chains.items()}}
    res: dict[str, dict[str, list]] = {k: {"prefill_ms": [], "decode_tok_s": []} for k in runs}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            pre, tps, toks = fn()
            res[name]["prefill_ms"].append(pre)
            res[name]["decode_tok_s"].append(tps)
            tokens[name] = toks
    ref = tokens["transformers_1t"]
    summary = {name: {"prefill_ms": round(statistics.median(r["prefill_ms"]), 1),
                      "decode_tok_s": round(statistics.median(r["decode_tok_s"]), 2),
                      "greedy_agreement": agreement(tokens[name], ref)}
               for name, r in res.items()}
    base = summary["transformers_1t"]["decode_tok_s"]
    print(json.dumps({"model": "SmolLM2-135M-Instruct", "prompt_tokens": len(prompt),
                      "decode_tokens": args.tokens, "rounds": args.rounds, "results": summary,
                      "onnx_fp32_1t_vs_transformers_1t": round(
                          summary["onnx_fp32_1t"]["decode_tok_s"] / base, 2)}, indent=1))


if __name__ == "__main__":
    main()
