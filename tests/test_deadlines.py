"""A decode step's deadline follows the plan (client/stepplane.py decode_timeout): a fixed
2 s floor refused every step of a plan whose tokens take longer (a large model on phones, nodes
under emulation: found planning the 1 B onto emulated aarch64 nodes)."""

from __future__ import annotations

import math

import pytest

from edgelite.client.stepplane import decode_timeout
from edgelite.config import ClientConfig

pytestmark = pytest.mark.unit


def test_the_floor_holds_for_fast_plans_and_slow_plans_get_their_multiple() -> None:
    cfg = ClientConfig()
    assert decode_timeout(cfg, 0.0) == cfg.step_timeout_s  # (no prediction)
    assert decode_timeout(cfg, math.inf) == cfg.step_timeout_s
    assert decode_timeout(cfg, 45.0) == cfg.step_timeout_s  # 45 ms a token: 0.9 s < 2 s
    assert decode_timeout(cfg, 2000.0) == pytest.approx(cfg.step_timeout_factor * 2.0)  # 2 s a token
    strict = ClientConfig(step_timeout_s=0.5, step_timeout_factor=4.0)
    assert decode_timeout(strict, 250.0) == pytest.approx(1.0)
