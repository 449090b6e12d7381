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


def build(arch: str, out: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random model of `arch` + tokenizer to `out` (a HF folder) and return it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    tok = tokenizer()
    cfg = AutoConfig.for_model(arch, vocab_size=VOCAB, eos_token_id=tok.eos_token_id,
                               bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                               initializer_range=0.1,
                               **{"max_position_embeddings": 256, **CONFIGS[arch], **overrides})
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
