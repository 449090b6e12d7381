"""Next-token choice from logits: greedy at temperature 0, else temperature, then top-k,
top-p and min-p."""

from __future__ import annotations

import numpy as np

from edgelite.topk import largest


def distribution(logits: np.ndarray, temperature: float, top_p: float, top_k: int = 0,
                 min_p: float = 0.0) -> np.ndarray:
    """The probabilities (vocab,) float64 a token is drawn from at temperature > 0: softmax
    of logits / temperature, cut to the `top_k` likeliest (0: all), to the smallest set whose
    mass reaches top_p, and to those at least min_p times the likeliest's probability."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if 0 < top_k < len(p):  # (then top-p and min-p within what is left)
        keep = largest(p, top_k)
        mask = np.zeros_like(p)
        mask[keep] = p[keep]
        p = mask / mask.sum()
    if top_p < 1.0:
        order = np.argsort(-p)
        keep = order[: int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1]
        mask = np.zeros_like(p)
        mask[keep] = p[keep]
        p = mask / mask.sum()
    if min_p > 0.0:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator,
           top_k: int = 0, min_p: float = 0.0) -> int:
    """logits (vocab,) -> token id."""
    if temperature <= 0:
        return int(np.argmax(logits))
    p = distribution(logits, temperature, top_p, top_k, min_p)
    return int(rng.choice(len(p), p=p))


def log_normalizer(logits: np.ndarray) -> float:
    """log(sum(exp(logits))): a token's log probability is its logit less this (the sum in
    float64 over float32 exponentials, ~10x a float64 log_softmax's speed)."""
    m = float(logits.max())
    e = np.exp((logits - np.float32(m)).astype(np.float32, copy=False))
    return m + float(np.log(e.sum(dtype=np.float64)))
