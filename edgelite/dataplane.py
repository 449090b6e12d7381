"""The node's forward path: one thread (a FrameThread) that owns the data connections.

A data connection starts like any other (handshake on the event loop), asks for
{type: data, plan_id, role: in | sink} and is then taken off the loop. `in` connections carry
FORWARD frames into this node; the `sink` connection of a plan (opened by its client to the last
stage) receives the RESULT frames. The thread reads a step, runs the stage's layers and writes
the result straight into the next stage's `in` connection (or the sink). The event loop keeps
answering control requests (pings, stats, deploys, probes) meanwhile; work that must be ordered
with steps (ending a session) is queued on the thread.

A bad frame closes its connection (logged once); a bad step gets an error result, on the
sender's connection when the step itself is malformed, else passed down the chain to the client.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from edgelite import wire
from edgelite.config import NodeConfig, WireLimits
from edgelite.errors import EdgeliteError, ProtocolError
from edgelite.framethread import FrameThread
from edgelite.stage import Stage, StageStore

log = logging.getLogger(__name__)


def check_forward(store: StageStore, msg: dict[str, Any], fingerprint: str | None,
                  limits: WireLimits) -> Stage:
    """Refuse a malformed step up front (on the sender's connection); decodes msg["hidden"]."""
    stage = store.stage_for(msg.get("plan_id"), fingerprint)
    if not isinstance(msg.get("session"), str) or not isinstance(msg.get("start"), int):
        raise ProtocolError("forward needs a string session and an integer start")
    trace = msg.setdefault("trace", [])
    if not isinstance(trace, list) or len(trace) >= limits.max_trace_stages:
        raise ProtocolError(f"trace must be a list of fewer than {limits.max_trace_stages} "
                            f"[compute_us, held_us] pairs")
    for t in trace:
        if not (isinstance(t, list) and len(t) == 2 and type(t[0]) is int and type(t[1]) is int):
            raise ProtocolError(f"trace must be a list of [compute_us, held_us] pairs, not {t!r}")
    if "error" not in msg:
        hidden = wire.decode_tensor(msg.get("hidden"), limits, "hidden")
        if hidden.ndim != 3 or hidden.shape[2] != stage.manifest.hidden_size:
            raise ProtocolError(f"hidden has shape {list(hidden.shape)}, expected "
                                f"(batch, seq, {stage.manifest.hidden_size})")
        msg["hidden"] = hidden
    return stage


class DataPlane(FrameThread):
    def __init__(self, name: str, store: StageStore, cfg: NodeConfig, limits: WireLimits) -> None:
        super().__init__("dataplane", limits, cfg.forward_timeout_s, cfg.queued_call_timeout_s,
                         cfg.shutdown_timeout_s)
        self.name, self.store, self.cfg = name, store, cfg
        self.inbound: dict[socket.socket, str | None] = {}  # -> the fingerprint it was opened for
        self.outbound: dict[tuple[str, int], socket.socket] = {}  # next stages' `in` connections
        self.sinks: dict[str, socket.socket] = {}  # plan_id -> its client's sink connection

    # ---- called from the event loop (each queues work for the thread) --------------------
    def add_inbound(self, sock: socket.socket, fingerprint: str | None) -> None:
        self.call(lambda: self._add_inbound(sock, fingerprint))

    def set_outbound(self, addr: tuple[str, int], sock: socket.socket) -> None:
        self.call(lambda: self._replace(self.outbound, addr, sock, "out"))

    def set_sink(self, plan_id: str, sock: socket.socket) -> None:
        self.call(lambda: self._replace(self.sinks, plan_id, sock, "sink"))

    def has_outbound(self, addr: tuple[str, int]) -> bool:
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

    def on_frame(self, sock: socket.socket, msg: dict[str, Any], t_in: float) -> None:
        if self.role(sock) == "out" and msg["type"] == "result":  # the next stage refused a step
            log.warning("the next stage refused a step: %s", msg.get("error"))
        elif sock not in self.inbound:
            self.on_bad_frame(sock, ProtocolError(f"{msg['type']!r} frame on a connection that "
                                                  f"only receives from this node"))
        elif msg["type"] != "forward":
            self.on_bad_frame(sock, ProtocolError(f"a data connection carries forward frames, "
                                                  f"not {msg['type']!r}"))
        else:
            self._step(sock, msg, t_in)

    def _step(self, sock: socket.socket, msg: dict[str, Any], t_in: float) -> None:
        try:
            stage = check_forward(self.store, msg, self.inbound.get(sock), self.limits)
        except EdgeliteError as exc:  # the sender gets the refusal, the connection stays
            self.bad_frames += 1
            log.info("forward refused: %s", exc)
            self.send(sock, {"type": "result", "session": msg.get("session"),
                             "step": msg.get("step"), "error": f"{self.name}: {exc}"})
            return
        self._forward(stage, msg, t_in)

    def _forward(self, stage: Stage, msg: dict[str, Any], t_in: float) -> None:
        """Run the step and pass it on. Everything after the layers is on the critical path of
        the whole pipeline and runs with caches cold from streaming the weights (measured: 10x
        the warm cost), so it does the least first and the bookkeeping after the send."""
        out = {"type": "forward" if stage.next_addr else "result", "plan_id": msg["plan_id"],
               "session": msg["session"], "step": msg.get("step")}
        ms, kv = 0.0, None
        try:
            if "error" in msg:
                raise EdgeliteError(msg["error"])  # an upstream stage failed: pass it on
            hidden, start = msg["hidden"], msg["start"]
            kv = self.store.prepare(stage, msg["session"], start, hidden)
            result, kv, ms = self.store.compute(stage, kv, start, hidden)
            out["start"], out["hidden"] = start, wire.encode_tensor(result)
        except EdgeliteError as exc:
            log.info("plan %s session %s: %s", msg.get("plan_id"), msg.get("session"), exc)
            out["error"] = f"{self.name}: {exc}"
        # what this stage adds to the step's time: running its layers, and all of its handling
        out["trace"] = [*msg["trace"], [round(ms * 1e3), round((time.perf_counter() - t_in) * 1e6)]]
        dest = (self.outbound.get(stage.next_addr) if stage.next_addr
                else self.sinks.get(msg["plan_id"]))
        if dest is None:
            log.warning("plan %s: no connection onward; step dropped", msg["plan_id"])
        elif not self.send(dest, out):
            self.close_conn(dest, "broken while sending")
        if kv is not None:  # the next step of this session comes after this one: commit now
            self.store.commit(stage, msg["session"], kv, ms)
