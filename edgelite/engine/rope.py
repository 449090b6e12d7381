"""Rotary embedding tables for GroupQueryAttention: cos and sin of position x frequency.

The exporter writes the model's own inverse frequencies (whatever its RoPE scaling: default,
linear, llama3, yarn) and attention scaling into the manifest, so the runtime needs no RoPE
variants of its own.
"""

from __future__ import annotations

import numpy as np

from edgelite.manifest import Manifest


def tables(manifest: Manifest, positions: int, local: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each (positions, rotary dimensions / 2) float32: the model's table, or
    (`local`) its windowed layers' own where it has one (Gemma 3)."""
    rope = manifest.rope.get("local", manifest.rope) if local else manifest.rope
    inv = np.asarray(rope["inv_freq"], np.float64)
    scale = float(rope.get("attention_scaling", 1.0))
    angles = np.outer(np.arange(positions, dtype=np.float64), inv)  # (positions, head_dim / 2)
    return ((np.cos(angles) * scale).astype(np.float32),
            (np.sin(angles) * scale).astype(np.float32))
