"""Tiny random HF models with a real (trained in-process) byte-level BPE tokenizer. No download."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "phones on one wifi network run one model together",
    "hello world, what is the capital of france? paris is.",
    "pipelines forward activations from stage to stage",
] * 20
VOCAB = 320


def tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


CONFIGS: dict[str, dict[str, Any]] = {
    # odd sizes on purpose: 3 heads of 16, one KV head (GQA 3:1)
    "llama": dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1,
                  num_hidden_layers=3, intermediate_size=80, tie_word_embeddings=True),
    "qwen2": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, intermediate_size=96, tie_word_embeddings=False),
    "mistral": dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1,
                    num_hidden_layers=2, intermediate_size=64, sliding_window=None,
                    head_dim=16),
}
# the families of issue 34, each with what sets it apart (head_dim 32: GroupQueryAttention's
# partial rotary needs rotary dimensions / 2 in multiples of 8)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3": ("gemma3_text", dict(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_hidden_layers=3, intermediate_size=96, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1000000.0}})),
    "qwen3": ("qwen3", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, num_hidden_layers=2, intermediate_size=96)),
    "phi3": ("phi3", dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                          num_hidden_layers=2, intermediate_size=96, partial_rotary_factor=0.5,
                          original_max_position_embeddings=256,
                          rope_scaling={"rope_type": "longrope", "short_factor": [1.5] * 8,
                                        "long_factor": [4.0] * 8,
                                        "original_max_position_embeddings": 256})),
    "llama3_rope": ("llama", dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                  num_hidden_layers=2, intermediate_size=96,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 32})),
    "mistral_window": ("mistral", dict(hidden_size=48, num_attention_heads=3,
                                       num_key_value_heads=1, head_dim=16, num_hidden_layers=2,
                                       intermediate_size=64, sliding_window=8)),
}


def build(arch: str, out: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random model of `arch` (a model type of CONFIGS, or a name of FAMILIES) +
    tokenizer to `out` (a HF folder) and return it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    tok = tokenizer()
    model_type, shape = FAMILIES[arch] if arch in FAMILIES else (arch, CONFIGS[arch])
    cfg = AutoConfig.for_model(model_type, vocab_size=VOCAB, eos_token_id=tok.eos_token_id,
                               bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                               initializer_range=0.1,
                               **{"max_position_embeddings": 256, **shape, **overrides})
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # make biases and norm weights matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in name:
                p.normal_(1.0, 0.2)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def load_hf(folder: Path | str, gguf_file: str | None = None) -> Any:
    """A whole transformers model (float32, eval), for tests that compare with it."""
    import torch
    from transformers import AutoModelForCausalLM

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)
    return model.eval()


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation (argmax at every step, EOS included), recomputing the
    whole sequence each step (no cache argument, whose name changes between versions)."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


# where the K-quants keep their float16 super-block scales (byte offsets in a block)
K_QUANT_F16 = {"Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> Any:
    """Random raw blocks of a GGUF type (its float16 scales small and finite)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    top = 2e-4 if kind == "Q6_K" else 1e-3  # (Q6_K: signed 8-bit sub-scales times 6-bit codes)
    for off in K_QUANT_F16[kind]:
        d = rng.uniform(top / 4, top, (rows, cols // block)).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def gguf_of(hf_dir: Path, out: Path, kind: str) -> Path:
    """A tiny Llama HF folder as a GGUF file whose matrices are `kind` blocks (quantized by the
    gguf package: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; or, for the K-quants, which it cannot make,
    random blocks: a mixture "Q4_K+Q6_K" alternates them), its tokenizer as llama.cpp's
    converter writes it. Every matrix's width must be whole blocks."""
    import json

    import gguf
    import numpy as np

    cfg = json.loads((hf_dir / "config.json").read_text())
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(out, "llama")
    if kind != "Q8_0":  # (one without general.name: then the file's name)
        w.add_name(f"Tiny Llama {kind}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    vocab = gguf.vocab.BpeVocab(hf_dir)
    tokens, _, types = zip(*vocab.all_tokens(), strict=True)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(list(tokens))
    w.add_token_types(list(types))
    gguf.SpecialVocab(hf_dir, load_merges=True).add_to_gguf(w, quiet=True)
    from safetensors.numpy import load_file

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i, (name, t) in enumerate(load_file(str(hf_dir / "model.safetensors")).items()):
        if name.startswith("model.layers."):
            _, _, j, rest = name.split(".", 3)
            gname = f"blk.{j}.{parts[rest.rsplit('.', 1)[0]]}.weight"
        else:
            gname = names[name]
        t = t.astype(np.float32)
        if "q_proj" in name or "k_proj" in name:  # llama.cpp's q/k row order
            n = heads if "q_proj" in name else kv
            t = t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        kinds = kind.split("+")
        this = kinds[i % len(kinds)]
        qtype = gguf.GGMLQuantizationType[this] if t.ndim == 2 else gguf.GGMLQuantizationType.F32
        if t.ndim == 2 and this in K_QUANT_F16:
            data = random_blocks(this, t.shape[0], t.shape[1], len(gname))
        else:
            data = gguf.quants.quantize(t, qtype)
        w.add_tensor(gname, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


LARGE_LAYER_MIB = 1500  # what an "as if large" export's layers say they hold once loaded


def as_if_large(model: Path, out: Path, layer_mib: int = LARGE_LAYER_MIB) -> Path:
    """A copy of an export whose manifest says each layer holds `layer_mib` once loaded (the
    embedding and head 1 MiB each, a prompt chunk 1 MiB): budgets of 2,000 MiB a process then
    hold exactly one layer each, whatever the processes' own few hundred MiB, so a test can
    make the planner split a tiny model. The files are the export's (same fingerprint)."""
    import dataclasses
    import shutil

    from edgelite import manifest as mf

    shutil.copytree(model, out)
    m = mf.load(out)
    # (the same on every device: the narrow figures, engine/matmul.c's, left unmeasured)
    big = [dataclasses.replace(e, resident_bytes=layer_mib << 20, scratch_bytes=1 << 20,
                               narrow_resident_bytes=0, narrow_scratch_bytes=0) for e in m.layers]
    small = {"resident_bytes": 1 << 20, "load_peak_bytes": 0, "narrow_resident_bytes": 0,
             "narrow_load_peak_bytes": 0}
    mf.write(dataclasses.replace(m, layers=big, embed=dataclasses.replace(m.embed, **small),
                                 head=dataclasses.replace(m.head, **small), range_bytes=0,
                                 narrow_range_bytes=0), out)
    return out
