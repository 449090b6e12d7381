"""The node's forward path: one thread (a FrameThread) that owns the data connections.

A data connection starts like any other (handshake on the event loop), asks for
{type: data, plan_id, role: in | sink} and is then taken off the loop. `in` connections carry
FORWARD frames into this node; the `sink` connection of a plan (opened by its client to the last
stage) receives the RESULT frames. The thread reads a step, runs the stage's layers and writes
the result straight into the next stage's `in` connection (or the sink). The event loop keeps
answering control requests (pings, stats, deploys, probes) meanwhile; work that must be ordered
with steps (ending a session) is queued on the thread.

A frame that is not a valid message gets an error reply (the connection stays, unless the
stream cannot be followed); a bad step gets an error result, on the sender's connection when the
step itself does not fit the stage, else passed down the chain to the client.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgelite.config import NodeConfig, WireLimits
from edgelite.engine.batch import padded_bytes
from edgelite.errors import EdgeliteError, ProtocolError
from edgelite.ids import NodeAddr
from edgelite.net import messages as m
from edgelite.net.framethread import FrameThread
from edgelite.net.schema import Message
from edgelite.node.stages import Stage, StageStore

log = logging.getLogger(__name__)


def check_forward(store: StageStore, msg: m.Forward, fingerprint: str | None) -> Stage:
    """Refuse a step that does not fit its stage up front (on the sender's connection); the
    schema has checked the fields' types already."""
    stage = store.stage_for(msg.plan_id, fingerprint)
    if msg.error is None:
        hidden = msg.hidden
        if hidden is None:
            raise ProtocolError("forward: needs hidden (or error)")
        if hidden.dtype != np.float32 or hidden.ndim != 3 or hidden.shape[2] != stage.manifest.hidden_size:
            raise ProtocolError(f"forward.hidden: {hidden.dtype} {list(hidden.shape)}, expected "
                                f"float32 (batch, seq, {stage.manifest.hidden_size})")
        if hidden.shape[0] < 1 or hidden.shape[1] < 1:
            raise ProtocolError(f"forward.hidden: shape {list(hidden.shape)} is empty")
    return stage


@dataclass
class Ready:
    """A checked step waiting for this select round's input to be all read (to batch it)."""

    sock: socket.socket
    msg: m.Forward
    t_in: float
    stage: Stage

    @property
    def decode(self) -> bool:
        return self.msg.error is None and self.msg.hidden is not None and self.msg.hidden.shape[:2] == (1, 1)


class DataPlane(FrameThread):
    def __init__(self, name: str, store: StageStore, cfg: NodeConfig, limits: WireLimits) -> None:
        super().__init__("dataplane", limits, cfg.forward_timeout_s, cfg.queued_call_timeout_s,
                         cfg.shutdown_timeout_s)
        self.name, self.store, self.cfg = name, store, cfg
        self.inbound: dict[socket.socket, str | None] = {}  # -> the fingerprint it was opened for
        self.outbound: dict[NodeAddr, socket.socket] = {}  # next stages' `in` connections
        self.sinks: dict[str, socket.socket] = {}  # plan_id -> its client's sink connection
        self.ready: list[Ready] = []  # steps read this round, run once all input is read
        self.batches = 0  # batched runs, and the steps in them
        self.batched_steps = 0

    # ---- called from the event loop (each queues work for the thread) --------------------
    def add_inbound(self, sock: socket.socket, fingerprint: str | None) -> None:
        self.call(lambda: self._add_inbound(sock, fingerprint))

    def set_outbound(self, addr: NodeAddr, sock: socket.socket) -> None:
        self.call(lambda: self._replace(self.outbound, addr, sock, "out"))

    def set_sink(self, plan_id: str, sock: socket.socket) -> None:
        self.call(lambda: self._replace(self.sinks, plan_id, sock, "sink"))

    def has_outbound(self, addr: NodeAddr) -> bool:
        return addr in self.outbound

    # ---- the thread ----------------------------------------------------------------------
    def _add_inbound(self, sock: socket.socket, fingerprint: str | None) -> None:
        self.inbound[sock] = fingerprint
        self.add(sock, "in")

    def _replace(self, table: dict, key: Any, sock: socket.socket, role: str) -> None:
        old = table.get(key)
        table[key] = sock
        self.add(sock, role)  # outbound and sinks are read only to see them close
        if old is not None:
            self.close_conn(old)

    def on_closed(self, sock: socket.socket, reason: str) -> None:
        log.debug("data connection ended: %s", reason)
        self.inbound.pop(sock, None)
        for table in (self.outbound, self.sinks):
            for k in [k for k, v in table.items() if v is sock]:
                del table[k]

    def on_frame(self, sock: socket.socket, msg: Message, t_in: float) -> None:
        if self.role(sock) == "out" and isinstance(msg, m.Result):  # the next stage refused a step
            log.warning("the next stage refused a step: %s", msg.error)
        elif sock not in self.inbound:
            self.on_bad_frame(sock, ProtocolError(f"{msg.TYPE} frame on a connection that only "
                                                  f"receives from this node"), fatal=False)
        elif not isinstance(msg, m.Forward):
            self.on_bad_frame(sock, ProtocolError(f"a data connection carries forward frames, "
                                                  f"not {msg.TYPE}"), fatal=False)
        else:
            self._step(sock, msg, t_in)

    def _step(self, sock: socket.socket, msg: m.Forward, t_in: float) -> None:
        try:
            stage = check_forward(self.store, msg, self.inbound.get(sock))
        except EdgeliteError as exc:  # the sender gets the refusal, the connection stays
            self.bad_frames += 1
            log.info("forward refused: %s", exc)
            self.send(sock, m.Result(plan_id=msg.plan_id, session=msg.session, step=msg.step,
                                     start=msg.start, error=f"{self.name}: {exc}"))
            return
        self.ready.append(Ready(sock, msg, t_in, stage))

    def on_idle(self) -> None:
        """Run the steps read this round: decode steps of one plan together, up to the batch
        size, while the KV they copy stays under the configured size."""
        while self.ready:
            first = self.ready.pop(0)
            group, rest = [first], []
            for r in self.ready:
                if (first.decode and r.decode and r.stage is first.stage
                        and len(group) < self.cfg.batch_max_steps
                        and all(g.msg.session != r.msg.session for g in group)):
                    group.append(r)
                else:
                    rest.append(r)
            self.ready = rest
            if len(group) == 1:
                self._forward(first.stage, first.msg, first.t_in)
            else:
                self._forward_batch(group)

    def _forward_batch(self, group: list[Ready]) -> None:
        """Run and pass on a batch of decode steps. A step its session refuses (wrong start, no
        KV budget) gets its own answer; the rest go on together."""
        stage, ok, kvs = group[0].stage, [], []
        for r in group:
            try:
                kvs.append(self.store.prepare(stage, r.msg.session, r.msg.start, r.msg.hidden))
                ok.append(r)
            except EdgeliteError:
                self._forward(stage, r.msg, r.t_in)  # answers with the refusal
        if len(ok) >= 2 and padded_bytes(kvs) <= self.cfg.batch_max_kv_bytes:
            try:
                outs, kvs, ms = self.store.compute_batch(stage, kvs, [r.msg.start for r in ok],
                                                         [r.msg.hidden for r in ok])
            except (EdgeliteError, RuntimeError, ValueError) as exc:
                log.warning("a batch of %d steps failed (%r); running them one by one", len(ok), exc)
            else:
                self.batches += 1
                self.batched_steps += len(ok)
                for r, out in zip(ok, outs, strict=True):
                    self._pass_on(stage, r.msg, out, None, ms, r.t_in)
                for r, kv in zip(ok, kvs, strict=True):
                    self.store.commit(stage, r.msg.session, kv, ms / len(ok))
                return
        for r in ok:  # too few, too much KV to copy, or the batch failed
            self._forward(stage, r.msg, r.t_in)

    def _forward(self, stage: Stage, msg: m.Forward, t_in: float) -> None:
        """Run the step and pass it on. Everything after the layers is on the critical path of
        the whole pipeline and runs with caches cold from streaming the weights (measured: 10x
        the warm cost), so it does the least first and the bookkeeping after the send."""
        ms, kv, result, error = 0.0, None, None, msg.error
        if error is None:
            try:
                assert msg.hidden is not None  # check_forward
                kv = self.store.prepare(stage, msg.session, msg.start, msg.hidden)
                result, kv, ms = self.store.compute(stage, kv, msg.start, msg.hidden)
            except (EdgeliteError, RuntimeError, ValueError) as exc:  # onnxruntime: RuntimeError
                log.info("plan %s session %s: %s", msg.plan_id, msg.session, exc)
                error, kv = f"{self.name}: {exc}", None
        self._pass_on(stage, msg, result, error, ms, t_in)
        if kv is not None:  # the next step of this session comes after this one: commit now
            self.store.commit(stage, msg.session, kv, ms)

    def _pass_on(self, stage: Stage, msg: m.Forward, hidden: np.ndarray | None, error: str | None,
                 ms: float, t_in: float) -> None:
        # what this stage adds to the step's time: running its layers, all its handling
        trace = [*msg.trace, (round(ms * 1e3), round((time.perf_counter() - t_in) * 1e6))]
        kind = m.Forward if stage.next_addr else m.Result
        out = kind(plan_id=msg.plan_id, session=msg.session, step=msg.step, start=msg.start,
                   hidden=hidden, error=error, trace=trace)
        dest = (self.outbound.get(stage.next_addr) if stage.next_addr
                else self.sinks.get(msg.plan_id))
        if dest is None:
            log.warning("plan %s: no connection onward; step dropped", msg.plan_id)
        elif not self.send(dest, out):
            self.close_conn(dest, "broken while sending")
