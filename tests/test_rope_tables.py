"""RoPE tables made a block of positions at a time (engine/rope.py: the whole float64 angles of
a 32 k context took four times the tables' memory while they were made) hold the same bits as
the tables made at once."""

from __future__ import annotations

import numpy as np
import pytest

from edgelite.engine import rope


@pytest.mark.unit
def test_blocks_make_the_same_tables() -> None:
    inv = 1.0 / 10000 ** (np.arange(0, 64, 2) / 64)

    from types import SimpleNamespace  # (the manifest's RoPE fields are all tables() reads)

    m = SimpleNamespace(rope={"inv_freq": inv.tolist(), "attention_scaling": 0.75})
    positions = 2 * rope.TABLE_BLOCK + 123
    cos, sin = rope.tables(m, positions)  # type: ignore[arg-type]
    angles = np.outer(np.arange(positions, dtype=np.float64), inv)
    assert np.array_equal(cos, (np.cos(angles) * 0.75).astype(np.float32))
    assert np.array_equal(sin, (np.sin(angles) * 0.75).astype(np.float32))
    assert cos.dtype == np.float32 and cos.shape == (positions, 32)
