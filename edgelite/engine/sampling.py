"""Next-token choice from logits: greedy at temperature 0, else temperature + top-p."""

from __future__ import annotations

import numpy as np


def distribution(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """The probabilities (vocab,) float64 a token is drawn from at temperature > 0: softmax
    of logits / temperature, cut to the smallest set of tokens whose mass reaches top_p."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p)
        keep = order[: int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1]
        mask = np.zeros_like(p)
        mask[keep] = p[keep]
        p = mask / mask.sum()
    return p


def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """logits (vocab,) -> token id."""
    if temperature <= 0:
        return int(np.argmax(logits))
    p = distribution(logits, temperature, top_p)
    return int(rng.choice(len(p), p=p))
