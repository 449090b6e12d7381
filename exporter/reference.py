"""transformers' own model, one piece at a time: the reference the export is checked against.

The model is built with empty weights (accelerate's `init_empty_weights`: parameters on the
meta device, buffers such as RoPE's frequencies real), and a piece gets its weights only while
it runs: one decoder layer (transformers' own class for the architecture), the embedding rows
of the ids used, the final norm, the vocabulary projection a block of rows at a time. So the
whole model is never in memory. Weights come from the source file as transformers would load
them: a HF folder's tensors by their own names; a GGUF's through transformers' GGUF name map
and tensor processors, dequantized by the `gguf` package.

Attention is transformers' eager implementation (float32) under an explicit additive mask
(causal, and the window for a sliding-window layer).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from edgelite_export import families, reader
from edgelite_export.source import Opened

log = logging.getLogger(__name__)
HEAD_ROWS = 8192  # vocabulary rows of the head dequantized at once
DEQUANT_ROWS = 512  # rows of a GGUF tensor the gguf package dequantizes at once


class Reference:
    def __init__(self, opened: Opened) -> None:
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        self.files, self.gguf = opened.files, opened.gguf
        config = opened.config
        with init_empty_weights():
            self.model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        self.model.eval()
        self.config = self.model.config
        self.base = self.model.model
        self.hf_to_gguf: dict[str, str] = {}
        self.processor: Any = None
        if self.gguf:
            from transformers.modeling_gguf_pytorch_utils import (
                TENSOR_PROCESSORS,
                TensorProcessor,
                get_gguf_hf_weights_map,
            )

            arch = opened.files.architecture  # type: ignore[attr-defined]
            self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
            mapping = get_gguf_hf_weights_map(self.model, self.processor)
            self.hf_to_gguf = {hf: g for g, hf in mapping.items()}
        self.tied = self.model.lm_head.weight is self.base.embed_tokens.weight or bool(
            getattr(config, "tie_word_embeddings", False))

    # ---- weights ------------------------------------------------------------------------
    def tensor(self, hf_name: str, rows: reader.Rows = None) -> torch.Tensor:
        """A weight by its transformers name, float32 (rows a..b only, when given: the
        vocabulary projection in blocks)."""
        if not self.gguf:
            return torch.from_numpy(self._hf_float(hf_name, rows))
        name = self.hf_to_gguf.get(hf_name)
        if name is None:
            raise KeyError(f"transformers' GGUF name map has no tensor for {hf_name}")
        w = self._gguf_float(name, rows)
        w = self.processor.process(weights=w, name=name, tensor_key_mapping={},
                                   parsed_parameters={}).weights
        return torch.from_numpy(np.ascontiguousarray(w, np.float32))

    def _hf_float(self, name: str, rows: reader.Rows) -> np.ndarray:
        return self.files.float(name, rows)

    def _gguf_float(self, name: str, rows: reader.Rows) -> np.ndarray:
        """A GGUF tensor as transformers reads it: the gguf package's dequantization, in the
        file's (rows, columns) layout."""
        files = self.files
        assert isinstance(files, reader.GGUFFile)
        t = files.info(name)
        if t.kind in ("F32", "F16", "BF16", "F64"):
            return files.float(name, rows)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        raw, qtype = files.blocks(name, rows), GGMLQuantizationType[t.kind]
        out = None  # filled DEQUANT_ROWS rows at a time: the gguf package's dequantization
        for a in range(0, raw.shape[0], DEQUANT_ROWS):  # holds several copies of what it makes
            part = dequantize(raw[a:a + DEQUANT_ROWS], qtype)
            if out is None:
                out = np.empty((raw.shape[0], part.shape[1]), np.float32)
            out[a:a + part.shape[0]] = part
        assert out is not None
        return out

    def _materialize(self, module: torch.nn.Module, prefix: str) -> torch.nn.Module:
        """The module with its parameters read from the source (assigned, not copied)."""
        state = {k: self.tensor(prefix + k) for k, _ in module.named_parameters()}
        module.load_state_dict(state, strict=False, assign=True)
        return module

    def _release(self, module: torch.nn.Module) -> None:
        """Give the parameters back (the module is empty again)."""
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(torch.empty(p.shape, device="meta"),
                                                     requires_grad=False))
        for child in module.children():
            self._release(child)

    # ---- pieces -------------------------------------------------------------------------
    def layer_weights(self, j: int) -> dict[str, torch.Tensor]:
        """Layer j's parameters by their transformers names (model.layers.J.*)."""
        layer = self.base.layers[j]
        prefix = f"model.layers.{j}."
        return {prefix + k: self.tensor(prefix + k) for k, _ in layer.named_parameters()}

    @torch.no_grad()
    def run_layer(self, j: int, weights: dict[str, torch.Tensor], hiddens: list[torch.Tensor]
                  ) -> list[torch.Tensor]:
        """Layer j over each sequence's hidden states (1, T, hidden) -> its outputs."""
        layer = self.base.layers[j]
        prefix = f"model.layers.{j}."
        layer.load_state_dict({k[len(prefix):]: v for k, v in weights.items()}, strict=True,
                              assign=True)
        try:
            return [self._call(layer, j, h) for h in hiddens]
        finally:
            self._release(layer)

    def _call(self, layer: torch.nn.Module, j: int, h: torch.Tensor) -> torch.Tensor:
        n = h.shape[1]
        pos = torch.arange(n)[None]
        rotary = self.base.rotary_emb
        if hasattr(rotary, "inv_freq"):
            cos_sin = rotary(h, pos)
        else:  # one table per layer type (Gemma 3: local and global layers)
            cos_sin = rotary(h, pos, self.config.layer_types[j])
        out = layer(h, attention_mask=self.mask(j, n), position_ids=pos,
                    position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out

    def rope(self) -> dict[str, Any]:
        """transformers' RoPE frequencies and scaling: `inv_freq`, `attention_scaling`, and for
        models with a table per layer type, the windowed layers' own as `local`."""
        rotary = self.base.rotary_emb

        def one(prefix: str) -> dict[str, Any] | None:
            inv = getattr(rotary, f"{prefix}inv_freq", None)
            if inv is None:
                return None
            return {"inv_freq": [float(x) for x in inv.float()],
                    "attention_scaling": float(getattr(rotary, f"{prefix}attention_scaling", 1.0))}

        plain = one("")
        if plain is not None:
            return plain
        full, local = one("full_attention_"), one("sliding_attention_")
        if full is None or local is None:  # every layer of one type
            found = full or local
            assert found is not None, "no RoPE frequencies in transformers' rotary embedding"
            return found
        return {**full, "local": local}

    def window(self, j: int) -> int | None:
        """Layer j's attention window (None: full), as transformers' models read the config."""
        return families.windows(self.config)[j] or None

    def mask(self, j: int, n: int) -> torch.Tensor:
        """(1, 1, n, n) additive: 0 where position q may see k, the dtype's minimum elsewhere."""
        q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = k <= q
        if (w := self.window(j)) is not None:
            allowed &= q - k < w
        return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]

    @torch.no_grad()
    def embed(self, ids: list[int]) -> torch.Tensor:
        """(1, T, hidden): the embedding of these ids (only their rows are read)."""
        uniq = sorted(set(ids))
        module = self.base.embed_tokens
        name = "model.embed_tokens.weight"
        rows = torch.cat([self.tensor(name, (i, i + 1)) for i in uniq])
        where = {t: i for i, t in enumerate(uniq)}
        saved = module.weight, module.padding_idx
        module.weight, module.padding_idx = torch.nn.Parameter(rows, requires_grad=False), None
        try:
            return module(torch.tensor([[where[t] for t in ids]]))
        finally:
            module.weight, module.padding_idx = saved

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> np.ndarray:
        """The final norm and the vocabulary projection: (T, vocab) float32 for (1, T, hidden),
        the projection's rows read HEAD_ROWS at a time."""
        norm = self._materialize(self.base.norm, "model.norm.")
        try:
            normed = norm(hidden)[0]
        finally:
            self._release(norm)
        name = "model.embed_tokens.weight" if self.tied else "lm_head.weight"
        vocab = self.config.vocab_size
        out = np.empty((normed.shape[0], vocab), np.float32)
        for a in range(0, vocab, HEAD_ROWS):
            b = min(vocab, a + HEAD_ROWS)
            out[:, a:b] = (normed @ self.tensor(name, (a, b)).T).numpy()
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            out = np.tanh(out / cap) * cap
        return out
