"""Deadlines for onnxruntime runs: a step far past what its range's own steps have taken is
cancelled (onnxruntime's RunOptions.terminate, checked between operators), so one graph that
runs away cannot hold the node's data-plane thread; its session gets the error, the node goes
on with the others.

One watchdog thread a process (started with the first guarded run) sleeps until the earliest
deadline of the runs in flight and sets `terminate` on those past theirs. A range keeps a
StepClock: the fastest time it has seen a step of each row count take, so a step's deadline
follows what this device does (`factor` times the slowest per-row rate seen, never under
`floor_s`: a first step has no history)."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from edgelite.errors import EdgeliteError


class StepDeadlineExceeded(EdgeliteError):
    """A step ran past its deadline and was cancelled."""


@dataclass
class Guard:
    """One guarded run: `fired` once the watchdog set its options' terminate flag."""

    options: Any  # onnxruntime.RunOptions
    due: float  # time.monotonic() past which it is cancelled
    fired: bool = False


class Watchdog:
    """The process's one thread that cancels runs past their deadlines."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._guards: dict[int, Guard] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._wake = float("inf")  # when the thread wakes next (a sooner deadline notifies it)

    @contextlib.contextmanager
    def guard(self, options: Any, seconds: float) -> Iterator[Guard]:
        """Run the body with `options.terminate` set once `seconds` have passed."""
        g = Guard(options, time.monotonic() + seconds)
        if seconds <= 0:  # (already due: cancelled before it starts)
            options.terminate = g.fired = True
        key = next(self._ids)
        with self._cond:
            self._guards[key] = g
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="step-deadlines", daemon=True)
                self._thread.start()
            if g.due < self._wake:
                self._cond.notify()
        try:
            yield g
        finally:
            with self._cond:
                del self._guards[key]

    def _watch(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for g in self._guards.values():
                    if not g.fired and g.due <= now:
                        g.options.terminate = True
                        g.fired = True
                waiting = [g.due for g in self._guards.values() if not g.fired]
                self._wake = min(waiting, default=float("inf"))
                self._cond.wait(None if not waiting else max(0.0, self._wake - now))


WATCHDOG = Watchdog()


class StepClock:
    """A range's step times: the deadline a step of `rows` rows gets."""

    def __init__(self, floor_s: float, factor: float) -> None:
        self.floor_s, self.factor = floor_s, factor
        self.fastest: dict[int, float] = {}  # rows -> the fastest step of that many seen (s)

    def deadline(self, rows: int) -> float:
        per_row = max((s / r for r, s in self.fastest.items()), default=0.0)
        return max(self.floor_s, self.factor * per_row * rows)

    def record(self, rows: int, seconds: float) -> None:
        if seconds < self.fastest.get(rows, float("inf")):
            self.fastest[rows] = seconds


def run_guarded(runs: list[tuple[Any, Any]], options: Any, seconds: float, what: str) -> None:
    """Each (session, io binding) run in turn with `options`, all cancelled past `seconds`
    (StepDeadlineExceeded names `what` and the deadline)."""
    options.terminate = False
    with WATCHDOG.guard(options, seconds) as g:
        try:
            for session, io in runs:
                session.run_with_iobinding(io, options)
        except RuntimeError as exc:  # onnxruntime's Fail on terminate (others: as they are)
            if g.fired:
                raise StepDeadlineExceeded(
                    f"{what}: the step ran past its deadline of {seconds:.1f} s and was cancelled") from exc
            raise
        if g.fired:  # (the flag came as the last operator finished: the step is whole)
            options.terminate = False
