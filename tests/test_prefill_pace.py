"""The prefill pace (serve/prefillpace.py): a chunk beside running replies halves while such
steps take more than `slowdown` times a decode-only step, and grows back when they are cheap;
a step with nobody decoding beside it prefills the most."""

from __future__ import annotations

import pytest

from edgelite.serve.prefillpace import PrefillPace


@pytest.mark.unit
def test_the_chunk_follows_what_steps_cost() -> None:
    pace = PrefillPace(most=64, least=8, slowdown=2.0)
    assert pace.size(decoding=True) == 64
    pace.timed(prefilled=True, decoded=True, ms=500.0)  # (nothing to compare with yet)
    assert pace.chunk == 64
    for _ in range(5):
        pace.timed(prefilled=False, decoded=True, ms=30.0)
    sizes = []
    for _ in range(5):  # a long prompt's chunks at a long context: 150 ms a step
        pace.timed(prefilled=True, decoded=True, ms=150.0)
        sizes.append(pace.chunk)
    assert sizes == [32, 16, 8, 8, 8] and pace.size(decoding=False) == 64
    pace.timed(prefilled=True, decoded=True, ms=25.0)  # cheap again: it grows back
    assert pace.chunk == 16
    pace.timed(prefilled=True, decoded=False, ms=900.0)  # prefill alone teaches nothing
    assert pace.chunk == 16
