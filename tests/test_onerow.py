"""Products whose one-row kernel is not their several-row one (engine/passes/onerow.py): a row comes
out the same alone and in a step of several, bit for bit, on any machine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edgelite.config import RuntimeConfig
from edgelite.engine.passes import onerow
from edgelite.engine.session import options

pytestmark = pytest.mark.engine

K, N = 576, 960  # SmolLM2's first product of a layer
CFG = RuntimeConfig(threads=1)


def _session(model: bytes) -> ort.InferenceSession:
    return ort.InferenceSession(model, options(CFG, Path(".")), providers=["CPUExecutionProvider"])


def _alone_and_together(session: ort.InferenceSession, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row of x (1, m, K) run alone, and the m rows as one step."""
    alone = np.concatenate([session.run(None, {"hidden": x[:, i:i + 1]})[0] for i in range(x.shape[1])], 1)
    return alone, session.run(None, {"hidden": x})[0]


@pytest.mark.parametrize(("bits", "level"), [(4, 4), (8, 4)])
def test_a_row_is_the_same_alone_and_with_others(bits: int, level: int) -> None:
    model = onerow.product_model((bits, 32, level), K, N)
    x = np.random.default_rng(2).standard_normal((1, 5, K)).astype(np.float32)
    alone, together = _alone_and_together(_session(onerow.pad_products(model, CFG)), x)
    assert alone.shape == together.shape == (1, 5, N)
    assert np.array_equal(alone, together)
    # where this machine's kernel differs, the graph was rewritten because it had to be
    raw_alone, raw_together = _alone_and_together(_session(model), x)
    assert np.array_equal(raw_alone, raw_together) != onerow.varies((bits, 32, level), CFG)
    np.testing.assert_allclose(alone, raw_together, rtol=1e-5, atol=1e-5)


def test_a_graph_without_varying_products_is_left_as_it_is() -> None:
    model = onerow.product_model((4, 32, 4), K, N)
    if onerow.varies((4, 32, 4), CFG):
        assert onerow.pad_products(model, CFG) != model
    else:
        assert onerow.pad_products(model, CFG) == model


def test_exact_modes_products_are_left_as_they_are() -> None:
    """Accuracy level 0 (float compute): two rows cost about twice one; not padded."""
    model = onerow.product_model((4, 32, 0), K, N)
    assert onerow.pad_products(model, CFG) == model
