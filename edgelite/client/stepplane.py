"""The client's end of a plan's steps: one thread that owns the data connections and every
session's client-side state, and runs the client's part of each step.

A step's life, in order, all on this thread:
1. `_begin`: the client's part before the stages (embedding, its own prefix layers) on the new
   ids at the session's position, then a Forward frame to the first node stage. A prompt goes
   as several chunks (at most the engine's largest chunk each), sent back to back: the stages
   work on chunk k+1 while the next stage works on chunk k;
2. the stages pass it along the chain (node/dataplane.py) and the last one sends the Result back
   on the sink connection;
3. `on_frame`: the session's position advances; a last chunk's result waits for the end of the
   read (`on_idle`), where the head runs once on every session's result that came in with it
   (a node sends the results of its batched steps back to back) and each caller's future gets
   its logits. One hand-off from the event loop and one back.
Failure: a step not answered within its deadline fails with StepTimeout (the caller finds out
which node stalled); a data connection that closes fails every step in flight with
NodeUnavailable; a refused step fails with NodeError. The session's position counts only
confirmed tokens; after a failure mid-prompt the session is broken (its stages may hold
different lengths) and must be ended.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from edgelite.config import ClientConfig, WireLimits
from edgelite.engine.runtime import ClientPart, chunks_of
from edgelite.errors import EdgeliteError, NodeError, NodeUnavailable, ProtocolError
from edgelite.ids import NodeAddr, PlanId, SessionId
from edgelite.net import messages as m
from edgelite.net import stepframe
from edgelite.net.framethread import FrameThread
from edgelite.net.schema import Message
from edgelite.net.stepframe import LEN
from edgelite.net.steptrace import StepTrace

log = logging.getLogger(__name__)


class StepTimeout(EdgeliteError):
    """No result within the step's deadline (the caller finds out which stage is to blame)."""


@dataclass
class SessionState:
    """A session as the client's side of the pipeline sees it (touched on the thread only)."""

    position: int = 0  # tokens every stage confirmed holding KV for
    sent: int = 0  # tokens sent (position + those in flight)
    broken: str | None = None  # why the session cannot go on


@dataclass
class InFlight:
    session: SessionId
    step: int
    tokens: int
    fut: asyncio.Future[np.ndarray]
    last: bool  # the prompt's last chunk (its result goes through the head)
    every: bool  # the head runs at every position (a speculative step's verification)
    normed: bool  # ... and gives the final norm's output, not logits (Backend.hidden)
    t0: float  # perf_counter when sent
    timeout_s: float
    deadline: float  # monotonic


@dataclass
class Job:
    """A step asked for by the event loop, waiting for the thread."""

    session: SessionId
    ids: np.ndarray  # (1, seq) int64
    fut: asyncio.Future[np.ndarray]
    every: bool = False  # one chunk, logits at every position (StepPlane.verify)
    normed: bool = False  # (with every) the final norm's output instead (Backend.hidden)


def decode_timeout(cfg: ClientConfig, predicted_ms: float) -> float:
    """How long a decode step may go unanswered before its stages are suspected: the configured
    floor, or `step_timeout_factor` times the plan's predicted ms a token where longer."""
    if not math.isfinite(predicted_ms) or predicted_ms <= 0:
        return cfg.step_timeout_s
    return max(cfg.step_timeout_s, cfg.step_timeout_factor * predicted_ms / 1e3)


class StepPlane(FrameThread):
    def __init__(self, loop: asyncio.AbstractEventLoop, part: ClientPart, plan_id: PlanId,
                 first: NodeAddr, last: NodeAddr, nodes: int, cfg: ClientConfig,
                 limits: WireLimits, predicted_ms: float = 0.0) -> None:
        super().__init__("client-steps", limits, cfg.prefill_timeout_s, cfg.request_timeout_s,
                         cfg.shutdown_timeout_s)
        self.loop, self.part, self.plan_id, self.cfg = loop, part, plan_id, cfg
        self.decode_timeout = decode_timeout(cfg, predicted_ms)
        self.first, self.last = first, last  # the nodes at each end of the data connections
        # the stages a prompt's chunks pass through (the client's layers, if any, and the
        # nodes'): how finely a prompt is cut (chunks_of)
        self.stages = nodes + (part.prefix is not None)
        self.data_in: socket.socket | None = None
        self.sessions: dict[SessionId, SessionState] = {}
        self.in_flight: dict[tuple[SessionId, int], InFlight] = {}
        # steps sent; each step's number (its key in flight) is unique across sessions and
        # their restarts, so a late result of an ended session's step (a node answering after
        # the end) is never taken for a step of a new session of that id
        self.steps = 0
        self.gone: NodeUnavailable | None = None
        self.traces: deque[StepTrace] = deque(maxlen=cfg.trace_window)
        self.done: list[tuple[InFlight, np.ndarray]] = []  # results read, waiting for the head
        self.asked: list[Job] = []  # steps asked for on the event loop, not handed over yet
        self.head_runs = 0  # runs of the head, and the results they served
        self.head_rows = 0

    # ---- called from the event loop ------------------------------------------------------
    def attach(self, data_in: socket.socket, sink: socket.socket) -> None:
        self.call(lambda: self._attach(data_in, sink))

    async def forward(self, session: SessionId, ids: np.ndarray, every: bool = False,
                   normed: bool = False) -> np.ndarray:
        """Append ids (1, seq) to the session; the logits (vocab,) of its last position, or
        (`every`: seq within one chunk, sent as one step) (seq, vocab) of every position, or
        (`every` and `normed`) (seq, hidden) the final norm's output at every position."""
        if not self.thread.is_alive():
            raise self.gone or EdgeliteError("this plan's step thread is not running (closed)")
        job = Job(session, ids, self.loop.create_future(), every, normed)
        self.asked.append(job)
        if len(self.asked) == 1:  # the steps asked for in this turn of the loop go together
            self.loop.call_soon(self._hand_over)
        return await job.fut

    def _hand_over(self) -> None:
        """The steps asked for since the last hand-over, to the thread as one piece of work:
        sessions whose results came together (one head run) send their next steps in one
        write, and the stages run them as one batch."""
        jobs, self.asked = self.asked, []
        if not self.thread.is_alive():  # closed since they were asked for
            for job in jobs:
                if not job.fut.done():
                    job.fut.set_exception(self.gone or EdgeliteError("the plan was closed"))
            return
        self.call(lambda: self._begin_all(jobs))

    async def start_at(self, session: SessionId, position: int) -> None:
        """A new session whose first `position` tokens every stage holds already (their KV
        came from the KV stores)."""
        await self.submit(lambda: self.sessions.__setitem__(session, SessionState(position, position)))

    async def rollback(self, session: SessionId, n: int) -> None:
        """The session's next step starts at position n (<= where it is): the stages and the
        client's layers drop the positions after it when that step comes."""
        await self.submit(lambda: self._rollback(session, n))

    async def end(self, session: SessionId) -> None:
        """Forget the session here (the stages are told by the cluster)."""
        await self.submit(lambda: self._end(session))

    def fail_all(self, exc: Exception) -> None:
        self.call(lambda: self._fail_all(exc))

    # ---- the thread ----------------------------------------------------------------------
    def _attach(self, data_in: socket.socket, sink: socket.socket) -> None:
        self.data_in = data_in
        self.add(data_in, "in")  # read too: stage 1 answers a malformed step on it
        self.add(sink, "sink")

    def _rollback(self, session: SessionId, n: int) -> None:
        state = self.sessions.get(session)
        if state is None or state.broken or state.sent != state.position or n > state.position:
            why = state.broken if state and state.broken else "not there, or a step in flight"
            raise EdgeliteError(f"session {session[:12]}: cannot go back to position {n} ({why})")
        self.part.rollback(session, n)
        state.position = state.sent = n

    def _end(self, session: SessionId) -> None:
        self.sessions.pop(session, None)
        self.part.end(session)
        for key in [k for k in self.in_flight if k[0] == session]:
            self._settle(self.in_flight.pop(key).fut, exc=EdgeliteError("the session was ended"))

    def _settle(self, fut: asyncio.Future[np.ndarray], result: np.ndarray | None = None,
                exc: BaseException | None = None) -> None:
        self._settle_all([(fut, result, exc)])

    def _settle_all(self, outcomes: list[tuple[asyncio.Future[np.ndarray], np.ndarray | None,
                                               BaseException | None]]) -> None:
        """Hand steps' outcomes to the event loop in one call: the sessions they wake ask for
        their next steps in the same turn of the loop (see _hand_over)."""
        def settle() -> None:
            for fut, result, exc in outcomes:
                if not fut.done():
                    if exc is None:
                        fut.set_result(result)  # type: ignore[arg-type]
                    else:
                        fut.set_exception(exc)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:
            log.debug("event loop closed; a step's outcome is dropped")

    def _begin_all(self, jobs: list[Job]) -> None:
        for job in jobs:
            try:
                self._begin(job)
            except Exception as exc:  # noqa: BLE001 - a bug: its caller gets it, the others go on
                self._failed("a step", exc)
                self._settle(job.fut, exc=exc)

    def _begin(self, job: Job) -> None:
        if job.fut.done():
            return  # cancelled while queued
        if self.gone is not None or self.data_in is None:
            self._settle(job.fut, exc=self.gone or EdgeliteError("the plan has no data connections"))
            return
        state = self.sessions.setdefault(job.session, SessionState())
        if state.broken or state.sent != state.position:
            self._settle(job.fut, exc=EdgeliteError(
                f"session {job.session[:12]}: {state.broken or 'a step is in flight already'}"))
            return
        n = int(job.ids.shape[1])
        rt = self.part.cfg
        bounds = [(0, n)] if job.every else list(chunks_of(
            n, rt.prefill_chunks, rt.chunk_overhead_tokens, self.stages, rt.pipeline_min_chunk))
        for k, (a, b) in enumerate(bounds):
            try:
                hidden = self.part.front(job.session, job.ids[:, a:b])
            except Exception as exc:  # noqa: BLE001 - the client's own layers failed: the caller's
                state.broken = f"the client's layers failed: {exc}"
                self._fail_session(job.session, exc)
                self._settle(job.fut, exc=exc)
                return
            timeout = (self.decode_timeout if b - a == 1 else self.cfg.prefill_timeout_s) * (k + 1)
            step = self.steps
            self.steps += 1
            self.in_flight[job.session, step] = InFlight(job.session, step, b - a, job.fut,
                                                         b == n, job.every, job.normed,
                                                         time.perf_counter(),
                                                         timeout, time.monotonic() + timeout)
            body = stepframe.encode_fields(1, self.plan_id, job.session, step, state.sent, hidden)
            state.sent += b - a
            if not self.send_frames(self.data_in, LEN.pack(len(body)) + body, "forward"):
                self.close_conn(self.data_in, "broken while sending")
                return

    def on_frame(self, sock: socket.socket, msg: Message, t_in: float) -> None:
        if isinstance(msg, m.Error):  # the node refused a frame
            log.warning("node %s refused a frame: %s", self.first, msg.message)
            return
        if not isinstance(msg, m.Result):
            self.on_bad_frame(sock, ProtocolError(f"unexpected {msg.TYPE} frame"), fatal=False)
            return
        w = self.in_flight.pop((SessionId(msg.session), msg.step), None)
        if w is None:
            return  # its step timed out or was cancelled
        state = self.sessions.get(w.session)
        if msg.error is not None or msg.hidden is None:
            exc = NodeError(msg.error or "a stage returned no hidden state")
            if state is not None:
                state.broken = str(exc)
            self._fail_session(w.session, exc)
            self._settle(w.fut, exc=exc)
            return
        if state is not None:
            state.position += w.tokens
        self.traces.append(StepTrace(w.tokens, round((t_in - w.t0) * 1e6), tuple(msg.trace)))
        if w.last:
            self.done.append((w, msg.hidden))

    def _heads(self) -> None:
        """The head over every result read this round, as one run (of the same width: a
        result of the wrong hidden size fails alone)."""
        done, self.done = self.done, []
        groups: dict[tuple[int, np.dtype], list[tuple[InFlight, np.ndarray]]] = {}
        for w, hidden in done:
            if w.every:  # (a verification: every position, a run of its own)
                try:
                    self._settle(w.fut, self.part.normed_all(hidden) if w.normed
                                 else self.part.head_all(hidden))
                except Exception as exc:  # noqa: BLE001 - a bad result or the head failing: the caller's
                    self._settle(w.fut, exc=exc)
                continue
            groups.setdefault((hidden.shape[-1] if hidden.ndim == 3 else -1, hidden.dtype),
                              []).append((w, hidden))
        for members in groups.values():
            try:
                logits = self.part.heads([h for _, h in members])
            except Exception as exc:  # noqa: BLE001 - a bad result or the head failing: the callers'
                for w, _ in members:
                    self._settle(w.fut, exc=exc)
                continue
            self.head_runs += 1
            self.head_rows += len(members)
            self._settle_all([(w.fut, row, None) for (w, _), row in zip(members, logits, strict=True)])

    def _fail_session(self, session: SessionId, exc: BaseException) -> None:
        """Fail the session's other chunks still in flight."""
        for key in [k for k in self.in_flight if k[0] == session]:
            self._settle(self.in_flight.pop(key).fut, exc=exc)

    def on_closed(self, sock: socket.socket, reason: str) -> None:
        if self._stop:
            self._fail_all(EdgeliteError("the plan was closed"))
            return
        node = self.first if sock is self.data_in else self.last
        self.gone = NodeUnavailable(f"node {node} (a stage of this plan) closed the data "
                                    f"connection: {reason}", node=str(node))
        self._fail_all(self.gone)

    def _fail_all(self, exc: Exception) -> None:
        for w in self.in_flight.values():
            self._settle(w.fut, exc=exc)
        self.in_flight.clear()

    def next_timeout(self) -> float | None:
        if not self.in_flight:
            return None
        return max(0.0, min(w.deadline for w in self.in_flight.values()) - time.monotonic())

    def on_idle(self) -> None:
        if self.done:
            self._heads()
        if not self.in_flight:
            return
        now = time.monotonic()
        for key in [k for k, w in self.in_flight.items() if w.deadline <= now]:
            w = self.in_flight.pop(key, None)
            if w is None:
                continue
            exc = StepTimeout(f"no result within {w.timeout_s:g} s")
            if (state := self.sessions.get(w.session)) is not None:
                state.broken = str(exc)
            self._fail_session(w.session, exc)
            self._settle(w.fut, exc=exc)

    def cleanup(self) -> None:
        self._fail_all(EdgeliteError("the plan was closed"))
