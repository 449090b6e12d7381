"""Quality of SmolLM2-135M's quantized exports against the fp32 reference (the GGUF's own values,
dequantized: edgelite's fp32 export equals transformers on them within 1e-4).

- Teacher-forced over all of the fixed text in exporter/reference_text.py (written for this
  project, not by a model): top-1 agreement with the reference and mean KL(reference || export)
  at every position.
- Greedy: on 5 prompts, how many of 128 greedy tokens equal the reference's before the first
  difference (identical prefix), and how many positions agree in all.
- Where an export picks another token, how close the reference's own top two logits were
  there (a near tie flips on any rounding: the int8 activations of `fast` mode, or another
  engine's).
onnxruntime-genai's int4 (its builder re-quantizes the dequantized weights) is measured too when
it is installed (greedy only: its API gives the last position's logits). Prints one JSON object.

    python scripts/bench_quality.py [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from bench_local import edgelite_export, genai_build

PROMPTS = ["Write a short story about a robot who learns to paint.",
           "What is the capital of France?",
           "Explain in one sentence why the sky is blue.",
           "Give me three tips for learning a new language.",
           "How do plants make their food?"]


def chain(path: Path):
    from edgelite import manifest as mf
    from edgelite.config import RuntimeConfig
    from edgelite.engine.runtime import LocalChain

    return LocalChain(mf.load(path), RuntimeConfig(threads=2))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def greedy(c, prompt: list[int], n: int, margins: list[float] | None = None) -> list[int]:
    """n greedy ids; `margins` gets each step's gap between the two highest logits."""
    out, ids = [], np.array([prompt])
    for _ in range(n):
        logits = c.forward("g", ids)
        out.append(int(logits.argmax()))
        if margins is not None:
            top = np.partition(logits, -2)[-2:]
            margins.append(float(top[1] - top[0]))
        ids = np.array([[out[-1]]])
    c.end("g")
    return out


def genai_greedy(model: Path, prompt: list[int], n: int) -> list[int]:
    import onnxruntime_genai as og

    m = og.Model(str(model))
    params = og.GeneratorParams(m)
    params.set_search_options(max_length=len(prompt) + n, min_length=len(prompt) + n, do_sample=False)
    g = og.Generator(m, params)
    g.append_tokens(prompt)
    out = []
    while len(out) < n and not g.is_done():
        g.generate_next_token()
        out.append(int(g.get_next_tokens()[0]))
    return out


def compare(ref: list[int], got: list[int], margins: list[float]) -> dict:
    """How far `got` follows the reference's greedy ids; where it leaves them, how close the
    reference's own top two logits were there (a near tie flips on any rounding)."""
    prefix = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b),
                  min(len(ref), len(got)))
    equal = sum(a == b for a, b in zip(ref, got, strict=False))
    gap = round(margins[prefix], 4) if prefix < min(len(ref), len(got)) else None
    return {"identical_prefix": prefix, "equal_positions": equal,
            "reference_top2_logit_gap_at_divergence": gap}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--models", type=Path, default=Path("models/bench"))
    args = ap.parse_args()
    from edgelite import manifest as mf
    from edgelite.reply.tokenizer import Tokenizer
    from edgelite_export.reference_text import TEXT

    models = {"fp32": edgelite_export(args.models / "smol-fp32", "--quantize", "none"),
              "int4_exact": edgelite_export(args.models / "smol-int4-exact", "--mode", "exact"),
              "int4_fast": edgelite_export(args.models / "smol-int4-fast")}
    tok = Tokenizer(mf.load(models["fp32"]))
    text = tok.encode(TEXT)
    prompts = [tok.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    ref = chain(models["fp32"])
    ref_lp = log_softmax(ref.logits_all("t", np.array([text])))
    ref.end("t")
    top2 = np.sort(ref_lp, -1)[:, -2:]
    ref_gap = top2[:, 1] - top2[:, 0]  # (log-probabilities differ as the logits do)
    ref_margins: list[list[float]] = [[] for _ in prompts]
    ref_greedy = [greedy(ref, p, args.tokens, g) for p, g in zip(prompts, ref_margins, strict=True)]
    out: dict = {"text_positions": len(text), "greedy_tokens": args.tokens, "prompts": len(prompts),
                 "reference_top2_logit_gap_median": {"teacher_forced": round(float(np.median(ref_gap)), 3),
                                                     "greedy": round(float(np.median(ref_margins)), 3)},
                 "results": {}}
    for name in ("int4_exact", "int4_fast"):
        c = chain(models[name])
        lp = log_softmax(c.logits_all("t", np.array([text])))
        kl = float((np.exp(ref_lp) * (ref_lp - lp)).sum(-1).mean())
        runs = [compare(r, greedy(c, p, args.tokens), g)
                for r, p, g in zip(ref_greedy, prompts, ref_margins, strict=True)]
        differ = lp.argmax(-1) != ref_lp.argmax(-1)
        out["results"][name] = {
            "top1_agreement": round(float((~differ).mean()), 4),
            # how close the reference's top two were where the export picks another token
            "reference_top2_gap_where_top1_differs": {
                "max": round(float(ref_gap[differ].max()), 4) if differ.any() else None,
                "median": round(float(np.median(ref_gap[differ])), 4) if differ.any() else None},
            "mean_kl": round(kl, 5), "greedy": runs,
            "prompts_with_120_of_128_equal": sum(r["equal_positions"] >= 120 * args.tokens / 128
                                                 for r in runs),
            "bench_prompt_identical_prefix": runs[0]["identical_prefix"]}
    if (g := genai_build(args.models, "int4", 2)) is not None:
        runs = [compare(r, genai_greedy(g, p, args.tokens), mg)
                for r, p, mg in zip(ref_greedy, prompts, ref_margins, strict=True)]
        out["results"]["genai_int4"] = {"greedy": runs,
                                        "bench_prompt_identical_prefix": runs[0]["identical_prefix"]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
