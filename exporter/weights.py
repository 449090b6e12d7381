"""The weights to export, from either source: a loaded Hugging Face model (float tensors) or a
GGUF file (its quantized blocks, transcoded without rounding).

What `--quantize` does: GGUF block tensors keep their exact form (4- or 8-bit blocks) unless it
is `none` (then everything is float32); float tensors (every tensor of a HF source, and a GGUF's
F32/F16/BF16 ones) become 8- or 4-bit blocks for `int8`/`int4` (the embedding and the head at
8 bits either way) or stay float32 for `none`.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgelite.errors import SourceNotFound, UnsupportedModel
from edgelite_export import blocks
from edgelite_export.blocks import Blocks
from edgelite_export.graph import Arch, LayerWeights, Linear

log = logging.getLogger(__name__)
MODES = ("none", "int8", "int4")


@dataclass
class Weights:
    arch: Arch
    embed: np.ndarray | Blocks  # (vocab, hidden)
    head: np.ndarray | Blocks  # (vocab, hidden); the same object as `embed` when tied
    norm: np.ndarray
    layers: list[LayerWeights]
    kinds: Counter[str] = field(default_factory=Counter)  # how each weight was made

    @property
    def tied(self) -> bool:
        return self.head is self.embed

    def describe(self) -> dict[str, Any]:
        return dict(sorted(self.kinds.items()))


def arch_of(config: Any) -> Arch:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return Arch(config.hidden_size, heads, config.num_key_value_heads, head_dim,
                config.intermediate_size, config.vocab_size, float(config.rms_norm_eps))


class _Maker:
    """Turns float tensors into what the mode asks for, counting what it made."""

    def __init__(self, mode: str, kinds: Counter[str]) -> None:
        self.mode, self.kinds = mode, kinds

    def linear(self, w: np.ndarray) -> np.ndarray | Blocks:
        w = np.ascontiguousarray(w, np.float32)
        if self.mode == "none" or w.shape[1] % 32:
            self.kinds["float32"] += 1
            return w
        self.kinds[f"quantized {self.mode}"] += 1
        return blocks.quantize_int8(w) if self.mode == "int8" else blocks.quantize_int4(w)

    def table(self, w: np.ndarray) -> np.ndarray | Blocks:
        w = np.ascontiguousarray(w, np.float32)
        if self.mode == "none" or w.shape[1] % 32:
            self.kinds["float32"] += 1
            return w
        self.kinds["quantized int8"] += 1
        return blocks.quantize_int8(w)


def from_hf(model: Any, mode: str) -> Weights:
    """A transformers model's float weights, made into what `mode` asks for."""
    arch, kinds = arch_of(model.config), Counter[str]()
    make = _Maker(mode, kinds)

    def t(x: Any) -> np.ndarray:
        return x.detach().float().numpy()

    def lin(m: Any, table: bool = False) -> Linear:
        bias = None if getattr(m, "bias", None) is None else t(m.bias)
        return Linear(make.linear(t(m.weight)), bias)

    layers = []
    for layer in model.model.layers:
        at, mlp = layer.self_attn, layer.mlp
        layers.append(LayerWeights(t(layer.input_layernorm.weight), t(layer.post_attention_layernorm.weight),
                                   lin(at.q_proj), lin(at.k_proj), lin(at.v_proj), lin(at.o_proj),
                                   lin(mlp.gate_proj), lin(mlp.up_proj), lin(mlp.down_proj)))
    embed = make.table(t(model.model.embed_tokens.weight))
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    head = embed if tied else make.table(t(model.lm_head.weight))
    return Weights(arch, embed, head, t(model.model.norm.weight), layers, kinds)


# ---- GGUF ---------------------------------------------------------------------------------
PERMUTED = ("llama", "mistral")  # llama.cpp's converter reorders q/k rows for these


def _unpermute(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (rotary halves vs interleaved pairs)."""
    dim = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, dim, 2).swapaxes(1, 2).reshape(-1)


class GGUFSource:
    """A GGUF file's tensors by name, each as float32 or as transcoded blocks."""

    def __init__(self, path: Path, mode: str, kinds: Counter[str]) -> None:
        try:
            import gguf
        except ImportError as exc:
            from edgelite.errors import MissingDependency

            raise MissingDependency("reading GGUF files needs gguf: pip install "
                                    "'edgelite[export]'") from exc
        self.gguf, self.path, self.mode, self.kinds = gguf, path, mode, kinds
        try:
            reader = gguf.GGUFReader(str(path))
        except (ValueError, OSError, IndexError, KeyError) as exc:
            raise SourceNotFound(f"{path}: not a readable GGUF file ({exc})") from exc
        self.tensors = {t.name: t for t in reader.tensors}
        self.make = _Maker(mode, kinds)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def kinds_in_file(self) -> Counter[str]:
        return Counter(t.tensor_type.name for t in self.tensors.values())

    def float(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        data = np.asarray(t.data)
        if t.tensor_type.name in ("F32", "F16"):
            return data.astype(np.float32)
        return self.gguf.quants.dequantize(data, t.tensor_type).astype(np.float32)

    def matrix(self, name: str, rows: np.ndarray | None = None, table: bool = False) -> np.ndarray | Blocks:
        """(N, K): blocks when the tensor is quantized (unless the mode is none), else float."""
        t = self.tensors[name]
        kind = t.tensor_type.name
        n, k = int(t.shape[1]), int(t.shape[0])  # GGUF lists dims innermost first
        if kind in blocks.TRANSCODERS and self.mode != "none":
            b = blocks.TRANSCODERS[kind](np.asarray(t.data), n, k)
            self.kinds[f"transcoded {kind}"] += 1
            return b if rows is None else b.rows(rows)
        if kind not in ("F32", "F16", "BF16") and kind not in blocks.TRANSCODERS and self.mode != "none":
            raise UnsupportedModel(f"{self.path}: tensor {name} is {kind}, which cannot be "
                                   f"transcoded; supported: {', '.join(blocks.TRANSCODERS)}, F32, "
                                   f"F16, BF16 (or export with --quantize none)")
        w = self.float(name).reshape(n, k)
        if rows is not None:
            w = w[rows]
        return self.make.table(w) if table else self.make.linear(w)


def from_gguf(path: Path, config: Any, mode: str) -> Weights:
    arch, kinds = arch_of(config), Counter[str]()
    src = GGUFSource(path, mode, kinds)
    model_type = config.model_type
    q_rows = _unpermute(arch.heads * arch.head_dim, arch.heads) if model_type in PERMUTED else None
    k_rows = (_unpermute(arch.kv_heads * arch.head_dim, arch.kv_heads)
              if model_type in PERMUTED else None)

    def lin(name: str, rows: np.ndarray | None = None) -> Linear:
        bias = src.float(f"{name}.bias") if src.has(f"{name}.bias") else None
        if bias is not None and rows is not None:
            bias = bias[rows]
        return Linear(src.matrix(f"{name}.weight", rows), bias)

    layers = []
    for j in range(config.num_hidden_layers):
        p = f"blk.{j}"
        layers.append(LayerWeights(src.float(f"{p}.attn_norm.weight"), src.float(f"{p}.ffn_norm.weight"),
                                   lin(f"{p}.attn_q", q_rows), lin(f"{p}.attn_k", k_rows),
                                   lin(f"{p}.attn_v"), lin(f"{p}.attn_output"),
                                   lin(f"{p}.ffn_gate"), lin(f"{p}.ffn_up"), lin(f"{p}.ffn_down")))
    embed = src.matrix("token_embd.weight", table=True)
    head = src.matrix("output.weight", table=True) if src.has("output.weight") else embed
    log.info("GGUF %s: %s", path.name, dict(src.kinds_in_file()))
    return Weights(arch, embed, head, src.float("output_norm.weight"), layers, kinds)


def gguf_kinds(path: Path) -> Counter[str]:
    """The tensor types in a GGUF file (to pick the default export mode)."""
    return GGUFSource(path, "int4", Counter()).kinds_in_file()


def default_mode(kinds: Counter[str] | None) -> str:
    """What `--quantize` defaults to: the source's own width (float sources: none)."""
    if not kinds:
        return "none"
    if any(k.startswith(("Q4", "Q5", "Q2", "Q3")) for k in kinds):
        return "int4"
    if any(k.startswith(("Q8", "Q6")) for k in kinds):
        return "int8"
    return "none"
