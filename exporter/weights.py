"""The weights to export, read one layer at a time from the source's tensor file (a HF folder's
safetensors or a GGUF file) and made into what the graph builder takes.

What `--quantize` does: GGUF block tensors keep their exact form (transcoded, blocks.py) unless
it is `none` (then everything is float32); float tensors (every tensor of a HF source, and a
GGUF's F32/F16/BF16 ones) become 8- or 4-bit blocks for `int8`/`int4` (the embedding and the
head at 8 bits either way) or stay float32 for `none`.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import numpy as np

from edgelite.errors import UnsupportedModel
from edgelite_export import blocks, families, reader
from edgelite_export.blocks import Blocks
from edgelite_export.families import Family
from edgelite_export.graph import Arch, LayerWeights, Linear

log = logging.getLogger(__name__)
MODES = ("none", "int8", "int4")
CHUNK_ROWS = 4096  # rows of a float tensor read and quantized at once
FLOAT_KINDS = ("F32", "F16", "BF16", "F64")


def arch_of(config: Any, family: Family, rotary_dim: int = 0, local_rope: bool = False) -> Arch:
    """The graph's options: the config's shape and the family's ways."""
    windows = tuple(families.windows(config))
    return Arch(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                families.head_dim(config), config.intermediate_size, config.vocab_size,
                float(config.rms_norm_eps), act=family.act,
                attn_scale=families.attention_scale(config),
                embed_scale=families.embed_scale(family, config),
                windows=windows if any(windows) else (), local_rope=local_rope,
                rotary_dim=rotary_dim)


def _unpermute(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (rotary halves vs interleaved pairs)."""
    dim = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, dim, 2).swapaxes(1, 2).reshape(-1)


class Converter:
    """Reads the source's tensors by the family's names and makes each into what the mode asks
    for, counting what it made (`kinds`)."""

    def __init__(self, files: reader.TensorFile, family: Family, config: Any, mode: str,
                 arch: Arch | None = None) -> None:
        self.files, self.family, self.config, self.mode = files, family, config, mode
        self.gguf = isinstance(files, reader.GGUFFile)
        self.arch = arch or arch_of(config, family)
        self.kinds: Counter[str] = Counter()
        a, permuted = self.arch, self.gguf and config.model_type in family.permuted_qk
        self.rows = {"q": _unpermute(a.heads * a.head_dim, a.heads) if permuted else None,
                     "k": _unpermute(a.kv_heads * a.head_dim, a.kv_heads) if permuted else None}

    @property
    def tied(self) -> bool:
        head = self.family.global_name("head", self.gguf)
        if self.gguf:
            return not self.files.has(head)
        return bool(getattr(self.config, "tie_word_embeddings", False)) or not self.files.has(head)

    def describe(self) -> dict[str, Any]:
        return dict(sorted(self.kinds.items()))

    # ---- one tensor ---------------------------------------------------------------------
    def vector(self, name: str) -> np.ndarray:
        return np.ascontiguousarray(self.files.float(name).reshape(-1), np.float32)

    def norm_scale(self, name: str) -> np.ndarray:
        """An RMS norm's scale: the weight as stored, plus the family's offset for a HF
        checkpoint (Gemma stores w for a scale of 1 + w; its GGUF files store 1 + w)."""
        w = self.vector(name)
        offset = 0.0 if self.gguf else self.family.norm_offset_hf
        return w + np.float32(offset) if offset else w

    def matrix(self, name: str, rows: np.ndarray | None = None, table: bool = False) -> np.ndarray | Blocks:
        """(N, K): blocks when the tensor is quantized (unless the mode is none), else float
        made into what the mode asks for."""
        t = self.files.info(name)
        if len(t.shape) != 2:
            raise UnsupportedModel(f"{t.path}: tensor {name} has shape {list(t.shape)}, not a matrix")
        n, k = t.shape
        if t.kind in blocks.TRANSCODERS and self.mode != "none":
            b = blocks.TRANSCODERS[t.kind](self.files.raw(name), n, k)
            self.kinds[f"transcoded {t.kind}"] += 1
            return b if rows is None else b.rows(rows)
        if t.kind not in FLOAT_KINDS and t.kind not in blocks.TRANSCODERS and self.mode != "none":
            raise UnsupportedModel(f"{t.path}: tensor {name} is {t.kind}, which cannot be "
                                   f"transcoded; supported: {', '.join(blocks.TRANSCODERS)}, F32, "
                                   f"F16, BF16 (or export with --quantize none)")
        self.kinds[self._made(k, table)] += 1
        make = self._table if table else self._linear
        if rows is not None:  # a row permutation (q, k): small tensors, read whole
            return make(self.files.float(name).reshape(n, k)[rows])
        parts = [make(self.files.float(name, (a, min(a + CHUNK_ROWS, n))).reshape(-1, k))
                 for a in range(0, n, CHUNK_ROWS)]  # read and made a block of rows at a time
        if len(parts) == 1:
            return parts[0]
        if isinstance(parts[0], np.ndarray):
            return np.concatenate(parts)  # type: ignore[arg-type]
        joined = blocks.concat_rows(parts)  # type: ignore[arg-type]
        assert joined is not None
        return joined

    def _linear(self, w: np.ndarray) -> np.ndarray | Blocks:
        w = np.ascontiguousarray(w, np.float32)
        if self.mode == "none" or w.shape[1] % 32:
            return w
        return blocks.quantize_int8(w) if self.mode == "int8" else blocks.quantize_int4(w)

    def _table(self, w: np.ndarray) -> np.ndarray | Blocks:
        w = np.ascontiguousarray(w, np.float32)
        if self.mode == "none" or w.shape[1] % 32:
            return w
        return blocks.quantize_int8(w)

    def _made(self, k: int, table: bool) -> str:
        """What a float tensor with k columns becomes."""
        if self.mode == "none" or k % 32:
            return "float32"
        return "quantized int8" if table else f"quantized {self.mode}"

    def linear(self, base: str, rows: np.ndarray | None = None) -> Linear:
        bias = None
        if self.files.has(f"{base}.bias"):
            bias = self.vector(f"{base}.bias")
            bias = bias if rows is None else bias[rows]
        return Linear(self.matrix(f"{base}.weight", rows), bias)

    # ---- pieces -------------------------------------------------------------------------
    def layer(self, j: int) -> LayerWeights:
        names, a = self.family.names(j, self.gguf), self.arch
        if "qkv" in names:  # one tensor: q's rows, then k's, then v's
            q_rows, kv_rows = a.heads * a.head_dim, a.kv_heads * a.head_dim
            q, k, v = _split(self.linear(names["qkv"]), [q_rows, kv_rows, kv_rows])
        else:
            q, k, v = (self.linear(names[f], self.rows.get(f)) for f in ("q", "k", "v"))
        if "gate_up" in names:  # one tensor: the gate's rows, then up's
            gate, up = _split(self.linear(names["gate_up"]), [a.intermediate, a.intermediate])
        else:
            gate, up = self.linear(names["gate"]), self.linear(names["up"])
        norms = {f: self.norm_scale(names[f]) if f in names else None
                 for f in ("q_norm", "k_norm", "attn_out_norm", "mlp_out_norm")}
        return LayerWeights(self.norm_scale(names["ln1"]), self.norm_scale(names["ln2"]), q, k, v,
                            self.linear(names["o"]), gate, up, self.linear(names["down"]), **norms)

    def embed(self) -> np.ndarray | Blocks:
        return self.matrix(self.family.global_name("embed", self.gguf), table=True)

    def head(self, embed: np.ndarray | Blocks) -> np.ndarray | Blocks:
        """The vocabulary projection: `embed` itself (the same object) when tied."""
        if self.tied:
            return embed
        return self.matrix(self.family.global_name("head", self.gguf), table=True)

    def norm(self) -> np.ndarray:
        return self.norm_scale(self.family.global_name("norm", self.gguf))

    def layer_names(self, j: int) -> list[str]:
        """The tensors layer j reads (for sizes and checks)."""
        return [name if name.endswith(".weight") else f"{name}.weight"
                for name in self.family.names(j, self.gguf).values()]


def _split(lin: Linear, rows: list[int]) -> list[Linear]:
    """A fused projection's parts, by their numbers of rows."""
    out, a = [], 0
    for n in rows:
        w = lin.weight
        part = w[a:a + n] if isinstance(w, np.ndarray) else w.rows(np.arange(a, a + n))
        out.append(Linear(part, None if lin.bias is None else lin.bias[a:a + n]))
        a += n
    return out


def gguf_default_mode(files: reader.TensorFile) -> str:
    """What `--quantize` defaults to: the source's own width (float sources: none)."""
    if not isinstance(files, reader.GGUFFile):
        return "none"
    kinds = Counter(t.kind for t in files.tensors.values())
    if any(k.startswith(("Q4", "Q5", "Q2", "Q3")) for k in kinds):
        return "int4"
    if any(k.startswith(("Q8", "Q6")) for k in kinds):
        return "int8"
    return "none"


def export_bytes_of(t: reader.TensorInfo, mode: str) -> int:
    """About what a tensor takes in the export (for planning memory)."""
    n = int(np.prod(t.shape, dtype=np.int64))
    if mode == "none" or len(t.shape) != 2 or (t.kind in FLOAT_KINDS and t.shape[1] % 32):
        return 4 * n
    if t.kind in blocks.TRANSCODERS:
        bits = {"Q5_0": 8, "Q5_1": 8, "Q5_K": 8, "Q6_K": 8}.get(t.kind)
        return t.nbytes if bits is None else n + n // 8
    return n + n // 8 if mode == "int8" else n // 2 + n // 8


def need(conv: Converter) -> Any:
    """The export's memory need (memory.Need), from the tensor table alone."""
    from edgelite_export.memory import Need

    files, mode = conv.files, conv.mode
    per_layer = []
    for j in range(conv.config.num_hidden_layers):
        infos = [files.info(n) for n in conv.layer_names(j)]
        per_layer.append((sum(4 * int(np.prod(t.shape, dtype=np.int64)) for t in infos),
                          sum(export_bytes_of(t, mode) for t in infos)))
    tables = [conv.family.global_name("embed", conv.gguf)]
    if not conv.tied:
        tables.append(conv.family.global_name("head", conv.gguf))
    return Need(max(f for f, _ in per_layer), max(e for _, e in per_layer),
                sum(export_bytes_of(files.info(n), "int8" if mode != "none" else mode) for n in tables),
                len(per_layer), sum(e for _, e in per_layer))
