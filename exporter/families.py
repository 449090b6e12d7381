"""Model families as data: where each weight is in a HF checkpoint and in a GGUF file, and what
the layer graph must do differently. The converter (weights.py) reads this table and derives
the graph's options (graph.Arch) from it and the model's config; nothing else branches on the
architecture's name.

Names are patterns: `{j}` is the layer index. A linear layer is named without its `.weight` /
`.bias` suffix (a bias is used when the file has one). Layer fields:
  ln1            the norm before attention
  ln2            the norm before the MLP
  attn_out_norm  a norm of the attention's output before the residual add (Gemma 3)
  mlp_out_norm   a norm of the MLP's output before the residual add (Gemma 3)
  q_norm, k_norm per-head RMS norms of q and k before RoPE (Qwen3, Gemma 3)
  q, k, v, o     attention projections; `qkv` instead of q, k, v when they are one tensor (Phi-3)
  gate, up, down the gated MLP; `gate_up` instead of gate, up when they are one tensor (Phi-3)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from edgelite.errors import UnsupportedModel

_HF = "model.layers.{j}."
_ATTN = {
    "q": (_HF + "self_attn.q_proj", "blk.{j}.attn_q"),
    "k": (_HF + "self_attn.k_proj", "blk.{j}.attn_k"),
    "v": (_HF + "self_attn.v_proj", "blk.{j}.attn_v"),
    "o": (_HF + "self_attn.o_proj", "blk.{j}.attn_output"),
}
_MLP = {
    "gate": (_HF + "mlp.gate_proj", "blk.{j}.ffn_gate"),
    "up": (_HF + "mlp.up_proj", "blk.{j}.ffn_up"),
    "down": (_HF + "mlp.down_proj", "blk.{j}.ffn_down"),
}
_NORMS = {
    "ln1": (_HF + "input_layernorm.weight", "blk.{j}.attn_norm.weight"),
    "ln2": (_HF + "post_attention_layernorm.weight", "blk.{j}.ffn_norm.weight"),
}
_QK_NORMS = {
    "q_norm": (_HF + "self_attn.q_norm.weight", "blk.{j}.attn_q_norm.weight"),
    "k_norm": (_HF + "self_attn.k_norm.weight", "blk.{j}.attn_k_norm.weight"),
}
_GLOBAL = {
    "embed": ("model.embed_tokens.weight", "token_embd.weight"),
    "norm": ("model.norm.weight", "output_norm.weight"),
    "head": ("lm_head.weight", "output.weight"),
}


# Gemma's turn format, for sources that carry no template (some GGUF files): a system message
# goes before the first user turn's text; the assistant's role is "model"
GEMMA_CHAT = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] | trim + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{{ (prefix if loop.first else '') + m['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # transformers' config.model_type values
    gguf_archs: tuple[str, ...]  # GGUF general.architecture values
    layer: dict[str, tuple[str, str]]  # layer field -> (HF name, GGUF name)
    globals: dict[str, tuple[str, str]] = field(default_factory=lambda: dict(_GLOBAL))
    # llama.cpp's converter reorders q/k rows of these model types (rotary halves vs pairs)
    permuted_qk: tuple[str, ...] = ()
    # a HF checkpoint stores RMS norm weights as w for a scale of (w + this) (Gemma: 1); GGUF
    # files store the scale itself
    norm_offset_hf: float = 0.0
    act: str = "silu"  # the gated MLP's activation: silu | gelu_tanh
    scaled_embedding: bool = False  # embeddings times sqrt(hidden) (Gemma)
    eos_tokens: tuple[str, ...] = ()  # tokens that also end a reply (Gemma's <end_of_turn>)
    chat_template: str | None = None  # the family's turn format, when the source has none
    notes: str = ""  # what users know these as (error messages, README)

    def names(self, j: int, gguf: bool) -> dict[str, str]:
        return {k: v[int(gguf)].format(j=j) for k, v in self.layer.items()}

    def global_name(self, what: str, gguf: bool) -> str:
        return self.globals[what][int(gguf)]

    def has(self, what: str) -> bool:
        return what in self.layer


LLAMA = Family("llama", ("llama", "mistral", "qwen2"), ("llama", "qwen2"),
               {**_NORMS, **_ATTN, **_MLP}, permuted_qk=("llama", "mistral"),
               notes="Llama 2/3/3.x, SmolLM2, TinyLlama, Mistral, Qwen2/2.5")
QWEN3 = Family("qwen3", ("qwen3",), ("qwen3",), {**_NORMS, **_QK_NORMS, **_ATTN, **_MLP},
               notes="Qwen3 0.6B-8B")
GEMMA3 = Family("gemma3", ("gemma3_text",), ("gemma3",),
                {"ln1": _NORMS["ln1"],
                 "attn_out_norm": (_HF + "post_attention_layernorm.weight",
                                   "blk.{j}.post_attention_norm.weight"),
                 "ln2": (_HF + "pre_feedforward_layernorm.weight", "blk.{j}.ffn_norm.weight"),
                 "mlp_out_norm": (_HF + "post_feedforward_layernorm.weight",
                                  "blk.{j}.post_ffw_norm.weight"),
                 **_QK_NORMS, **_ATTN, **_MLP},
                norm_offset_hf=1.0, act="gelu_tanh", scaled_embedding=True,
                eos_tokens=("<end_of_turn>",), chat_template=GEMMA_CHAT,
                notes="Gemma 3 text (270M, 1B, 4B)")
PHI3 = Family("phi3", ("phi3",), ("phi3",),
              {**_NORMS, "qkv": (_HF + "self_attn.qkv_proj", "blk.{j}.attn_qkv"), "o": _ATTN["o"],
               "gate_up": (_HF + "mlp.gate_up_proj", "blk.{j}.ffn_up"), "down": _MLP["down"]},
              notes="Phi-3, Phi-4-mini")
FAMILIES = (LLAMA, QWEN3, GEMMA3, PHI3)


def supported_model_types() -> list[str]:
    return [t for f in FAMILIES for t in f.model_types]


def supported_gguf_archs() -> list[str]:
    return [a for f in FAMILIES for a in f.gguf_archs]


def _unsupported(what: str) -> UnsupportedModel:
    notes = "; ".join(f.notes for f in FAMILIES if f.notes)
    return UnsupportedModel(f"{what} is not supported; supported: "
                            f"{', '.join(supported_model_types())} ({notes})")


def by_model_type(model_type: str | None) -> Family:
    for f in FAMILIES:
        if model_type in f.model_types:
            return f
    raise _unsupported(f"architecture {model_type!r}")


def check_gguf_arch(arch: str) -> None:
    """Refuse a GGUF whose general.architecture no family reads (from its header alone)."""
    if arch not in supported_gguf_archs():
        raise _unsupported(f"architecture {arch!r} (GGUF general.architecture)")


# ---- what the config says ---------------------------------------------------------------
def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def windows(config: Any) -> list[int]:
    """Each layer's attention window (0: full attention): the config's layer_types where it
    has them (Gemma 3: 5 of every 6 layers local), else every layer when it sets a window
    (Mistral; Qwen2 only with use_sliding_window)."""
    n, window = config.num_hidden_layers, getattr(config, "sliding_window", None) or 0
    types = getattr(config, "layer_types", None)
    if types and window:
        return [window if t == "sliding_attention" else 0 for t in types]
    if window and (config.model_type == "mistral" or getattr(config, "use_sliding_window", False)):
        return [window] * n
    return [0] * n


def attention_scale(config: Any) -> float:
    """The softmax scale: 1/sqrt(query_pre_attn_scalar) where the model sets it (Gemma), else
    1/sqrt(head_dim)."""
    scalar = getattr(config, "query_pre_attn_scalar", None)
    return 1 / math.sqrt(scalar if scalar else head_dim(config))


def embed_scale(family: Family, config: Any) -> float:
    return math.sqrt(config.hidden_size) if family.scaled_embedding else 1.0
