"""The client's end of a plan's data connections: one thread sends steps and takes results.

Like a node's data plane, this thread owns the plan's two data connections: `in` to stage 1 and
`sink` from the last stage. A step is handed over once: the thread runs the client's part before
the stages (embedding, prefix layers), sends, and when the result comes back runs the part after
(the head) and only then wakes the event loop. That is one hand-off each way per token, as for
the single-process engine; going through the loop in between cost two more wake-ups per token.

Each step's timer starts when it is sent (time waiting behind another session's prefill on this
thread does not count against a stage). Results are matched by (session, step), so many sessions
are in flight at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgelite.config import ClientConfig, WireLimits
from edgelite.errors import EdgeliteError, NodeError, NodeUnavailable, ProtocolError
from edgelite.net import wire
from edgelite.net.framethread import FrameThread
from edgelite.net.steptrace import StepTrace, parse_trace

log = logging.getLogger(__name__)


class StepTimeout(EdgeliteError):
    """No result within the step's timeout (the caller finds out which stage is to blame)."""


@dataclass
class Waiter:
    fut: asyncio.Future
    after: Callable[[np.ndarray], Any]
    tokens: int
    t0: float  # perf_counter when sent
    timeout_s: float
    deadline: float  # monotonic


class StepPlane(FrameThread):
    def __init__(self, loop: asyncio.AbstractEventLoop, cfg: ClientConfig, limits: WireLimits,
                 first: str, last: str, on_lost: Callable[[str, str], None]) -> None:
        super().__init__("client-steps", limits, cfg.prefill_timeout_s, cfg.request_timeout_s,
                         cfg.shutdown_timeout_s)
        self.loop, self.cfg, self.on_lost = loop, cfg, on_lost
        self.names = {"in": first, "sink": last}  # the stage each connection goes to
        self.data_in: socket.socket | None = None
        self.waiting: dict[tuple[str, int], Waiter] = {}
        self.gone: NodeUnavailable | None = None
        self.traces: deque[StepTrace] = deque(maxlen=cfg.trace_window)

    # ---- called from the event loop ------------------------------------------------------
    def attach(self, data_in: socket.socket, sink: socket.socket) -> None:
        self.call(lambda: self._attach(data_in, sink))

    async def step(self, fields: dict[str, Any], tokens: int, before: Callable[[], np.ndarray],
                   after: Callable[[np.ndarray], Any]) -> Any:
        """Run before() here, send its output as the step `fields` describe (plan_id, session,
        step, start), and return after(the last stage's output)."""
        fut = self.loop.create_future()
        key = (fields["session"], fields["step"])
        self.call(lambda: self._start(key, fields, tokens, before, after, fut))
        try:
            return await fut
        except asyncio.CancelledError:
            self.call(lambda: self.waiting.pop(key, None))
            raise

    def fail_all(self, exc: Exception) -> None:
        self.call(lambda: self._fail_all(exc))

    # ---- the thread ----------------------------------------------------------------------
    def _attach(self, data_in: socket.socket, sink: socket.socket) -> None:
        self.data_in = data_in
        self.add(data_in, "in")  # read too: stage 1 answers a malformed step on it
        self.add(sink, "sink")

    def _settle(self, fut: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
        def settle() -> None:
            if not fut.done():
                if exc is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(exc)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:
            log.debug("event loop closed; a step's outcome is dropped")

    def _start(self, key: tuple[str, int], fields: dict[str, Any], tokens: int,
               before: Callable[[], np.ndarray], after: Callable[[np.ndarray], Any],
               fut: asyncio.Future) -> None:
        if fut.done():
            return  # cancelled while queued
        if self.gone is not None or self.data_in is None:
            self._settle(fut, exc=self.gone or EdgeliteError("the plan has no data connections"))
            return
        try:
            frame = {"type": "forward", **fields, "hidden": wire.encode_tensor(before())}
        except Exception as exc:  # noqa: BLE001 - the caller's own work failed: it gets the error
            self._settle(fut, exc=exc)
            return
        timeout = self.cfg.step_timeout_s if tokens == 1 else self.cfg.prefill_timeout_s
        t0 = time.perf_counter()
        self.waiting[key] = Waiter(fut, after, tokens, t0, timeout, time.monotonic() + timeout)
        if not self.send(self.data_in, frame):
            self.close_conn(self.data_in, "broken while sending")

    def on_frame(self, sock: socket.socket, msg: dict[str, Any], t_in: float) -> None:
        if msg["type"] == "error":  # the node refused a frame and closes the connection
            self.close_conn(sock, f"refused: {msg.get('message')}")
            return
        if msg["type"] != "result":
            self.on_bad_frame(sock, ProtocolError(f"unexpected {msg['type']!r} frame"))
            return
        w = self.waiting.pop((msg.get("session"), msg.get("step")), None)  # type: ignore[arg-type]
        if w is None:
            return  # its step timed out or was cancelled
        if "error" in msg:
            self._settle(w.fut, exc=NodeError(str(msg["error"])))
            return
        try:
            hidden = wire.decode_tensor(msg.get("hidden"), self.limits, "hidden")
            if (stages := parse_trace(msg.get("trace"))) is not None:
                self.traces.append(StepTrace(w.tokens, round((t_in - w.t0) * 1e6), stages))
            self._settle(w.fut, w.after(hidden))
        except Exception as exc:  # noqa: BLE001 - a bad result or the head failing: the caller's
            self._settle(w.fut, exc=exc)

    def on_closed(self, sock: socket.socket, reason: str) -> None:
        if self._stop:
            self._fail_all(EdgeliteError("the plan was closed"))
            return
        name = self.names["in"] if sock is self.data_in else self.names["sink"]
        self.gone = NodeUnavailable(f"node {name} (a stage of this plan) closed the data "
                                    f"connection: {reason}", node=name)
        self._fail_all(self.gone)
        try:
            self.loop.call_soon_threadsafe(self.on_lost, name, reason)
        except RuntimeError:
            log.debug("event loop closed")

    def _fail_all(self, exc: Exception) -> None:
        for w in self.waiting.values():
            self._settle(w.fut, exc=exc)
        self.waiting.clear()

    def next_timeout(self) -> float | None:
        if not self.waiting:
            return None
        return max(0.0, min(w.deadline for w in self.waiting.values()) - time.monotonic())

    def on_idle(self) -> None:
        if not self.waiting:
            return
        now = time.monotonic()
        for key in [k for k, w in self.waiting.items() if w.deadline <= now]:
            w = self.waiting.pop(key)
            self._settle(w.fut, exc=StepTimeout(f"no result within {w.timeout_s:g} s"))

    def cleanup(self) -> None:
        self._fail_all(EdgeliteError("the plan was closed"))
