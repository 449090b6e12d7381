"""The decode lane's reading of a step (net/stepframe.py `lone_step`) against the general one
(`parse`), on random frames and random corruptions of them: the lane takes only what `parse`
takes, reads the same fields, and the frame it builds onward parses as the step one stage on."""

from __future__ import annotations

import time

import numpy as np
import pytest

from edgelite.config import WireLimits
from edgelite.errors import ProtocolError
from edgelite.net import messages as m
from edgelite.net import stepframe as sf

pytestmark = pytest.mark.unit

LIMITS = WireLimits()
PLAN = "plan-7"
HIDDEN = 16
FRAMES = 1500


def random_step(rng: np.random.Generator) -> bytes:
    """A valid step body: most shaped like a decode step (one float32 token), some not."""
    lone = rng.random() < 0.6
    if lone:
        hidden = rng.standard_normal((1, 1, HIDDEN)).astype(np.float32)
    else:
        shape = tuple(int(x) for x in rng.integers(1, 4, size=int(rng.integers(1, 4))))
        hidden = rng.standard_normal(shape).astype(rng.choice([np.float32, np.float16]))
    error = None if rng.random() < 0.9 else "it broke"
    trace = [(int(a), int(b)) for a, b in rng.integers(0, 1000, size=(int(rng.integers(0, 4)), 2))]
    return sf.encode_fields(1 if rng.random() < 0.9 else 2, PLAN if rng.random() < 0.9 else "other",
                            f"s{int(rng.integers(0, 99))}", int(rng.integers(0, 1 << 40)),
                            int(rng.integers(0, 4096)), None if error else hidden, error, trace)


def corrupt(rng: np.random.Generator, body: bytes) -> bytes:
    raw = bytearray(body)
    for _ in range(int(rng.integers(1, 4))):
        how = rng.random()
        if how < 0.6 and raw:
            raw[int(rng.integers(0, min(len(raw), 40)))] = int(rng.integers(0, 256))  # (the header)
        elif how < 0.8:
            raw = raw[:int(rng.integers(sf.HEAD.size, len(raw) + 1))]
        else:
            raw += bytes(int(rng.integers(1, 9)))
    return bytes(raw)


def check_agrees(body: bytes) -> bool:
    """lone_step's reading of `body` against parse's; whether the lane took it."""
    lone = sf.lone_step(memoryview(body), PLAN.encode(), HIDDEN, onward=True)
    try:
        step = sf.parse(body, LIMITS)
    except ProtocolError:
        assert lone is None, "the lane took a frame parse refuses"
        return False
    if lone is None:
        return False
    session, start, prefix, tensor, tail = lone
    assert isinstance(step, m.Forward) and step.plan_id == PLAN and step.error is None
    assert (step.session, step.start) == (session, start)
    assert step.hidden is not None and step.hidden.dtype == np.float32 and step.hidden.shape == (1, 1, HIDDEN)
    assert bytes(tensor) == step.hidden.tobytes()
    out = np.arange(HIDDEN, dtype=np.float32)
    frame = sf.lane_frame(prefix, tail, 1.5, time.perf_counter(), out.tobytes())
    assert sf.LEN.unpack_from(frame)[0] == len(frame) - sf.LEN.size
    onward = sf.parse(frame[sf.LEN.size:], LIMITS)
    assert isinstance(onward, m.Forward) and (onward.session, onward.start, onward.step) == (
        step.session, step.start, step.step)
    assert onward.trace[:-1] == step.trace and len(onward.trace) == len(step.trace) + 1
    assert np.array_equal(onward.hidden, out.reshape(1, 1, HIDDEN))
    return True


def test_the_lane_reads_random_steps_as_parse_does() -> None:
    rng = np.random.default_rng(11)
    taken = sum(check_agrees(random_step(rng)) for _ in range(FRAMES))
    assert FRAMES * 0.3 < taken < FRAMES * 0.7, taken  # (both ways are exercised)


def test_the_lane_never_takes_a_corrupt_step_parse_refuses() -> None:
    rng = np.random.default_rng(12)
    taken = sum(check_agrees(corrupt(rng, random_step(rng))) for _ in range(FRAMES))
    assert taken < FRAMES // 2, taken


def test_the_lane_builds_a_result_for_the_last_stage() -> None:
    body = sf.encode_fields(1, PLAN, "s1", 5, 9, np.ones((1, 1, HIDDEN), np.float32), None, [(1, 2)])
    lone = sf.lone_step(memoryview(body), PLAN.encode(), HIDDEN, onward=False)
    assert lone is not None
    frame = sf.lane_frame(lone[2], lone[4], 0.5, 0.0, np.zeros(HIDDEN, np.float32).tobytes())
    # (a since_s long past, or a compute time out of range: the entry is clamped, never an error)
    result = sf.parse(frame[sf.LEN.size:], LIMITS)
    assert isinstance(result, m.Result) and result.trace[0] == (1, 2) and len(result.trace) == 2
    assert sf.lone_step(memoryview(body), b"another", HIDDEN, True) is None  # (another plan)
    assert sf.lone_step(memoryview(body), PLAN.encode(), HIDDEN + 8, True) is None  # (another width)
