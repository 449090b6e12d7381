"""SmolLM2-135M on one device: edgelite (fp32, int4 exact, int4 fast) beside onnxruntime-genai
(fp32 and int4, its model builder run on the same Hugging Face weights the exporter loads).

Every measurement runs in a fresh process (load, warm up, 128 greedy decode tokens after a short
prompt; RSS after load), and the configurations take turns round by round, in a rotating order,
at 1 and at 2 threads: drift on this shared machine hits them alike. Prints one JSON object.

    python scripts/bench_local.py [--rounds 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Write a short story about a robot who learns to paint."


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024


# ---- one measurement (runs in its own process) -------------------------------------------
def measure_edgelite(model: str, threads: int, tokens: int) -> dict:
    import numpy as np

    from edgelite import manifest as mf
    from edgelite.config import RuntimeConfig
    from edgelite.engine.runtime import LocalChain
    from edgelite.reply.tokenizer import Tokenizer

    m = mf.load(model)
    chain = LocalChain(m, RuntimeConfig(threads=threads))
    rss = rss_mib()
    prompt = Tokenizer(m).chat_prompt([{"role": "user", "content": PROMPT}])
    tok = int(chain.forward("w", np.array([prompt])).argmax())
    for _ in range(8):  # warm up
        tok = int(chain.forward("w", np.array([[tok]])).argmax())
    chain.end("w")
    tok = int(chain.forward("s", np.array([prompt])).argmax())
    t0 = time.perf_counter()
    for _ in range(tokens):
        tok = int(chain.forward("s", np.array([[tok]])).argmax())
    return {"tok_s": tokens / (time.perf_counter() - t0), "rss_mib": rss}


def measure_genai(model: str, threads: int, tokens: int) -> dict:
    import onnxruntime_genai as og

    cfg = og.Config(model)
    cfg.clear_providers()
    m = og.Model(cfg)
    tok = og.Tokenizer(m)
    rss = rss_mib()
    prompt = tok.encode(f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n")
    params = og.GeneratorParams(m)
    params.set_search_options(max_length=len(prompt) + tokens + 16, do_sample=False)
    g = og.Generator(m, params)
    g.append_tokens(prompt)
    for _ in range(8):
        g.generate_next_token()
    t0 = time.perf_counter()
    for _ in range(tokens):
        g.generate_next_token()
    return {"tok_s": tokens / (time.perf_counter() - t0), "rss_mib": rss}


# ---- preparing the models ----------------------------------------------------------------
def edgelite_export(out: Path, *flags: str) -> Path:
    if not (out / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "edgelite_export", "smollm2-135m", "--out", str(out),
                        *flags], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def smollm2_floats(out: Path) -> Path:
    """SmolLM2-135M as a HF folder of float32 weights: its GGUF's values, dequantized."""
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(Path(__file__).parent.parent))
    from edgelite_export import source

    src = source.resolve("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(src.folder, gguf_file=src.gguf_file)
    model.hf_quantizer = None  # its weights are plain float32 tensors now
    del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src.folder, gguf_file=src.gguf_file).save_pretrained(out)
    return out


def genai_build(models: Path, precision: str, threads: int) -> Path | None:
    """onnxruntime-genai's own export of the same weights (None when it is not installed)."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return None
    hf = smollm2_floats(models / "smollm2-hf")
    out = models / f"genai-{precision}-t{threads}"
    if not (out / "genai_config.json").is_file():
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf),
                        "-o", str(out), "-p", precision, "-e", "cpu", "-c", str(models / "genai-cache")],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cfg_path = out / "genai_config.json"
        cfg = json.loads(cfg_path.read_text())
        opts = cfg["model"]["decoder"].setdefault("session_options", {})
        opts.update(intra_op_num_threads=threads, inter_op_num_threads=1)
        cfg_path.write_text(json.dumps(cfg, indent=1))
    return out


def weight_mib(model: Path) -> float:
    from edgelite import manifest as mf

    m = mf.load(model)
    return sum(d.bytes for d in {d for e in m.files for d in e.data}) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--models", type=Path, default=Path("models/bench"))
    ap.add_argument("--measure", nargs=3, help=argparse.SUPPRESS)  # kind, model, threads (child)
    args = ap.parse_args()
    if args.measure:
        kind, model, threads = args.measure
        fn = measure_genai if kind == "genai" else measure_edgelite
        print(json.dumps(fn(model, int(threads), args.tokens)))
        return
    args.models.mkdir(parents=True, exist_ok=True)
    edge = {"edgelite_fp32": edgelite_export(args.models / "smol-fp32", "--quantize", "none"),
            "edgelite_int4_exact": edgelite_export(args.models / "smol-int4-exact", "--mode", "exact"),
            "edgelite_int4_fast": edgelite_export(args.models / "smol-int4-fast")}
    threads = [int(t) for t in args.threads.split(",")]
    configs: list[tuple[str, int, str, Path]] = []
    for t in threads:
        configs += [(name, t, "edgelite", path) for name, path in edge.items()]
        for precision in ("fp32", "int4"):
            if (g := genai_build(args.models, precision, t)) is not None:
                configs.append((f"genai_{precision}", t, "genai", g))
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        shift = r % len(configs)
        for name, t, kind, path in configs[shift:] + configs[:shift]:
            out = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens),
                                  "--measure", kind, str(path), str(t)], capture_output=True,
                                 text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": str(t)})
            runs.setdefault(f"{name}@{t}", []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    table = {k: {"tok_s": round(statistics.median(x["tok_s"] for x in v), 1),
                 "rss_mib": round(statistics.median(x["rss_mib"] for x in v)),
                 "tok_s_runs": [round(x["tok_s"], 1) for x in v]} for k, v in runs.items()}
    ratios = {}
    for t in threads:
        def ts(name: str, t: int = t) -> float | None:
            return table.get(f"{name}@{t}", {}).get("tok_s")
        for a, b in (("edgelite_int4_fast", "genai_int4"), ("edgelite_int4_exact", "genai_int4"),
                     ("edgelite_int4_fast", "edgelite_fp32"), ("edgelite_fp32", "genai_fp32")):
            if ts(a) and ts(b):
                ratios[f"{a}/{b}@{t}"] = round(ts(a) / ts(b), 3)
    weights = {name: round(weight_mib(path), 1) for name, path in edge.items()}
    memory = {f"{name}@{t}": {"rss_mib": table[f"{name}@{t}"]["rss_mib"], "weight_mib": weights[name],
                              "limit_mib": round(1.3 * weights[name] + 64, 1)}
              for name in edge for t in threads}
    print(json.dumps({"model": "SmolLM2-135M-Instruct (Q4_1 GGUF)", "decode_tokens": args.tokens,
                      "rounds": args.rounds, "results": table, "ratios": ratios,
                      "memory_after_load": memory}, indent=1))


if __name__ == "__main__":
    main()
