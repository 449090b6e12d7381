"""Rotary embedding tables for GroupQueryAttention: cos and sin of position x frequency.

The exporter writes the model's own inverse frequencies (whatever its RoPE scaling: default,
linear, llama3, yarn) and attention scaling into the manifest, so the runtime needs no RoPE
variants of its own.
"""

from __future__ import annotations

import numpy as np

from edgelite.manifest import Manifest

TABLE_BLOCK = 2048  # positions whose angles are computed at once


def tables(manifest: Manifest, positions: int, local: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each (positions, rotary dimensions / 2) float32: the model's table, or
    (`local`) its windowed layers' own where it has one (Gemma 3)."""
    rope = manifest.rope.get("local", manifest.rope) if local else manifest.rope
    inv = np.asarray(rope["inv_freq"], np.float64)
    scale = float(rope.get("attention_scaling", 1.0))
    cos = np.empty((positions, len(inv)), np.float32)
    sin = np.empty_like(cos)
    # a block of positions at a time: the float64 angles of a 32 k context whole took four
    # times the tables' memory while they were made (Gemma 3: 64 MiB above what a range holds)
    for a in range(0, positions, TABLE_BLOCK):
        angles = np.outer(np.arange(a, min(a + TABLE_BLOCK, positions), dtype=np.float64), inv)
        cos[a:a + len(angles)] = np.cos(angles) * scale
        sin[a:a + len(angles)] = np.sin(angles) * scale
    return cos, sin
