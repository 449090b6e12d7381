"""Torch modules traced into ONNX: embedding, one decoder layer with explicit KV, head.

The attention is written out here (not HF's attention class) so the graph has plain inputs:
past KV tensors, explicit position ids and a 0/1 attention mask over past+current positions.
MLP and RMSNorm are the HF modules themselves.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

MASK_VALUE = -1e9  # large negative, finite: a fully masked row gives a uniform softmax, never NaN


class Embed(nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.embed_tokens = model.model.embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # (batch, seq, hidden)


class Head(nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.norm, self.lm_head = model.model.norm, model.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))  # (batch, seq, vocab)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, model: Any, index: int) -> None:
        super().__init__()
        cfg = model.config
        layer = model.model.layers[index]
        attn = layer.self_attn
        self.input_layernorm, self.post_attention_layernorm = (layer.input_layernorm,
                                                               layer.post_attention_layernorm)
        self.mlp = layer.mlp
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (attn.q_proj, attn.k_proj,
                                                              attn.v_proj, attn.o_proj)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.scale = self.head_dim ** -0.5
        rot = model.model.rotary_emb
        self.register_buffer("inv_freq", rot.inv_freq.detach().clone().float(), persistent=False)
        self.rope_scale = float(getattr(rot, "attention_scaling", 1.0))

    def forward(self, hidden: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor,
                position_ids: torch.Tensor, attention_mask: torch.Tensor):
        b, s, _ = hidden.shape
        past = past_key.shape[2]
        x = self.input_layernorm(hidden)
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)  # (b, h, s, d)
        k = self.k_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)  # (b, kv, s, d)
        v = self.v_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        freqs = position_ids[:, None, :, None].float() * self.inv_freq  # (b, 1, s, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.rope_scale, emb.sin() * self.rope_scale
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        present_key = torch.cat((past_key, k), dim=2)  # (b, kv, past+s, d)
        present_value = torch.cat((past_value, v), dim=2)
        groups = self.n_heads // self.n_kv
        qg = q.reshape(b, self.n_kv, groups * s, self.head_dim)  # heads of a group share K/V
        scores = torch.matmul(qg, present_key.transpose(2, 3)) * self.scale  # (b, kv, g*s, t)
        t = present_key.shape[2]
        q_pos = torch.arange(s, device=hidden.device)[:, None] + past  # (s, 1)
        k_pos = torch.arange(t, device=hidden.device)[None, :]  # (1, t)
        allowed = (k_pos <= q_pos)[None, None] & (attention_mask[:, None, None, :] > 0)  # (b,1,s,t)
        bias = torch.where(allowed, 0.0, MASK_VALUE).to(scores.dtype)
        scores = scores.view(b, self.n_kv, groups, s, t) + bias[:, :, None]
        probs = torch.softmax(scores, dim=-1).view(b, self.n_kv, groups * s, t)
        out = torch.matmul(probs, present_value)  # (b, kv, g*s, d)
        out = out.view(b, self.n_heads, s, self.head_dim).transpose(1, 2).reshape(b, s, -1)
        hidden = hidden + self.o_proj(out)
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, present_key, present_value
