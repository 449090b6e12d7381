"""edgelite/topk.py against a full sort: the same indices in the same order (largest first,
ties to the lower index, NaN smallest), on vocabulary-sized vectors and small ones."""

from __future__ import annotations

import numpy as np
import pytest

from edgelite.topk import largest

pytestmark = pytest.mark.unit


def reference(x: np.ndarray, k: int) -> np.ndarray:
    v = np.where(np.isnan(x), -np.inf, x.astype(np.float64))
    return np.lexsort((np.arange(len(x)), -v))[:max(0, min(k, len(x)))]


@pytest.mark.parametrize("n", [1, 7, 4095, 4096, 49152, 49155, 151936])
@pytest.mark.parametrize("k", [0, 1, 5, 32, 200, 5000])
def test_largest_matches_a_full_sort(n: int, k: int) -> None:
    rng = np.random.default_rng(n * 31 + k)
    x = rng.standard_normal(n).astype(np.float32)
    assert np.array_equal(largest(x, k), reference(x, k))
    ties = np.round(x * 2).astype(np.float32)  # few distinct values: ties at the border
    assert np.array_equal(largest(ties, k), reference(ties, k))


def test_the_top_in_one_block_and_nan_and_infinities() -> None:
    x = np.zeros(49152, np.float32)
    x[100:140] = np.arange(40, dtype=np.float32) + 1  # all of the top in one block of 64
    assert np.array_equal(largest(x, 32), reference(x, 32))
    x[5], x[9000], x[20] = np.nan, np.inf, -np.inf
    got = largest(x, 40)
    assert got[0] == 9000 and 5 not in got and np.array_equal(got, reference(x, 40))
    assert np.array_equal(largest(np.full(8192, np.nan, np.float32), 3), [0, 1, 2])
    assert largest(x.astype(np.float64), 3).dtype == np.int64
