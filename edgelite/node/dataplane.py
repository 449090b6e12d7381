"""The node's forward path: one thread (a FrameThread) that owns the data connections.

A data connection starts like any other (handshake on the event loop), asks for
{type: data, plan_id, role: in | sink} and is then taken off the loop. `in` connections carry
FORWARD frames into this node; the `sink` connection of a plan (opened by its client to the last
stage) receives the RESULT frames. The thread reads a step, runs the stage's layers and writes
the result straight into the next stage's `in` connection (or the sink). The event loop keeps
answering control requests (pings, stats, deploys, probes) meanwhile; work that must be ordered
with steps (ending a session) is queued on the thread.

A decode step that is the only input of its wait, of a session this node holds, takes the
decode lane (`on_lone_step`): it runs from the frame's bytes into the next stage's frame, with
no message objects; everything else goes the general way (`on_frame`, `on_idle`): decode
steps read in one round run as one batch where they share a layer range (of one plan, or of
several clients' plans of one model), split once into two waves when they are more than half of
the range's sessions.

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
from edgelite.engine.kv import Slot
from edgelite.errors import EdgeliteError, ProtocolError
from edgelite.net import messages as m
from edgelite.net import stepframe as sf
from edgelite.net.framethread import FrameThread
from edgelite.net.schema import Message
from edgelite.node.stages import Session, Stage, StageStore

log = logging.getLogger(__name__)


def check_forward(store: StageStore, msg: m.Forward, plan_id: str, fingerprint: str | None) -> Stage:
    """Refuse a step that does not fit its stage up front (on the sender's connection); the
    schema has checked the fields' types already. `plan_id`: the plan the connection was
    opened for (with its capability): a step of another plan is refused."""
    if msg.plan_id != plan_id:
        raise ProtocolError(f"forward.plan_id: this connection carries plan {plan_id[:12]}, "
                            f"not {msg.plan_id[:12]}")
    stage = store.stage_for(msg.plan_id, fingerprint)
    if len(msg.trace) >= m.MAX_STAGES:
        raise ProtocolError(f"forward.trace: the step has passed {len(msg.trace)} stages already")
    if msg.error is None:
        hidden = msg.hidden
        if hidden is None:
            raise ProtocolError("forward: needs hidden (or error)")
        if hidden.dtype != np.float32 or hidden.ndim != 3 or hidden.shape[2] != stage.manifest.hidden_size:
            raise ProtocolError(f"forward.hidden: {hidden.dtype} {list(hidden.shape)}, expected "
                                f"float32 (batch, seq, {stage.manifest.hidden_size})")
        if hidden.shape[0] != 1 or not 1 <= hidden.shape[1] <= stage.max_chunk:
            raise ProtocolError(f"forward.hidden: shape {list(hidden.shape)}; a step carries one "
                                f"session's 1-{stage.max_chunk} tokens (batch 1; this plan's "
                                f"memory was counted for chunks of {stage.max_chunk})")
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
    LONE_STEPS = True  # decode steps may take the lane (on_lone_step)

    def __init__(self, name: str, store: StageStore, cfg: NodeConfig, limits: WireLimits) -> None:
        super().__init__("dataplane", limits, cfg.forward_timeout_s, cfg.queued_call_timeout_s,
                         cfg.shutdown_timeout_s)
        self.name, self.store, self.cfg = name, store, cfg
        # `in` connections -> the plan and model fingerprint each was opened for
        self.inbound: dict[socket.socket, tuple[str, str | None]] = {}
        self.outbound: dict[str, socket.socket] = {}  # plan_id -> the next stage's `in` connection
        self.sinks: dict[str, socket.socket] = {}  # plan_id -> its client's sink connection
        self.ready: list[Ready] = []  # steps read this round, run once all input is read
        # steps of sessions whose KV is being read from the KV store, until it is in place
        self.waiting: dict[tuple[str, str], list[Ready]] = {}
        # sessions whose restore failed before any step came: the next step is told why
        self.unrestored: dict[tuple[str, str], str] = {}
        # `in` connections whose steps passed check_forward: the stage and the plan id as
        # bytes, for the decode lane (on_lone_step)
        self.lanes: dict[socket.socket, tuple[Stage, bytes]] = {}
        self.lane_steps = 0  # decode steps run by the lane
        self.batches = 0  # batched runs, and the steps in them
        self.batched_steps = 0

    # ---- called from the event loop (each queues work for the thread) --------------------
    def add_inbound(self, sock: socket.socket, plan_id: str, fingerprint: str | None) -> None:
        self.call(lambda: self._add_inbound(sock, plan_id, fingerprint))

    def set_outbound(self, plan_id: str, sock: socket.socket) -> None:
        self.call(lambda: self._replace(self.outbound, plan_id, sock, "out"))

    def set_sink(self, plan_id: str, sock: socket.socket) -> None:
        self.call(lambda: self._replace(self.sinks, plan_id, sock, "sink"))

    async def install(self, stage: Stage) -> None:
        """Make a loaded stage live (after its earlier stage of the same plan, if any, with
        that one's connections and sessions)."""
        def install() -> None:
            self._close_plan(stage.plan_id)
            self.store.install(stage)
        await self.submit(install)

    async def unload(self, plan_id: str) -> int:
        """Unload a plan: its data connections, sessions and (unless shared) layers."""
        def unload() -> int:
            self._close_plan(plan_id)
            return self.store.unload(plan_id)
        return await self.submit(unload)

    # ---- the thread ----------------------------------------------------------------------
    def _add_inbound(self, sock: socket.socket, plan_id: str, fingerprint: str | None) -> None:
        if plan_id not in self.store.stages:  # unloaded while the connection was handed over
            sock.close()
            return
        self.inbound[sock] = (plan_id, fingerprint)
        self.add(sock, "in")

    def _close_plan(self, plan_id: str) -> None:
        for table in (self.waiting, self.unrestored):
            for key in [k for k in table if k[0] == plan_id]:
                del table[key]
        socks = [s for s, (p, _) in self.inbound.items() if p == plan_id]
        socks += [t[plan_id] for t in (self.outbound, self.sinks) if plan_id in t]
        for sock in socks:
            self.close_conn(sock, f"plan {plan_id[:12]} unloaded")

    def _replace(self, table: dict, key: Any, sock: socket.socket, role: str) -> None:
        old = table.get(key)
        table[key] = sock
        self.add(sock, role)  # outbound and sinks are read only to see them close
        if old is not None and old is not sock:
            self.close_conn(old)

    def on_closed(self, sock: socket.socket, reason: str) -> None:
        log.debug("data connection ended: %s", reason)
        self.inbound.pop(sock, None)
        self.lanes.pop(sock, None)
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

    def on_lone_step(self, sock: socket.socket, body: memoryview, t_in: float) -> bool:
        """The decode lane: a step of one token of a live session, alone in this wait, runs
        from the frame's bytes into the next stage's frame, with no message objects. It takes
        only what the general path (`_step`) would accept and run as it is, checked in the
        same terms (see stepframe.py for the layout); anything else, or anything unusual (a
        new session, a KV bucket to grow into, a restore under way, a step already queued),
        returns False and goes the general way."""
        lane = self.lanes.get(sock)
        if lane is None or self.ready or self.waiting or self.unrestored or self.store.restoring:
            return False
        stage, plan = lane
        got = sf.lone_step(body, plan, stage.manifest.hidden_size, stage.next_addr is not None)
        if got is None or self.store.stages.get(stage.plan_id) is not stage:
            return False
        session, start, prefix, tensor, tail = got
        sess = self.store.sessions.get((stage.plan_id, session))
        dest = (self.outbound if stage.next_addr else self.sinks).get(stage.plan_id)
        if (sess is None or sess.stage is not stage or sess.slot.length != start or start < 1
                or dest is None or stage.layers.pool.bucket(start) <= start):
            return False  # (no KV growth beyond its bucket: no budget to check)
        t0 = time.perf_counter()
        try:
            out = stage.layers.decode_bytes(sess.slot, tensor)
        except (EdgeliteError, RuntimeError, ValueError) as exc:  # as `_forward` answers it
            log.info("plan %s session %s: %s", stage.plan_id, session[:12], exc)
            msg = sf.parse(body, self.limits)
            assert isinstance(msg, m.Forward)  # (checked above)
            self._pass_on(stage, msg, None, f"{self.name}: {exc}", 0.0, t_in)
            return True
        ms = (time.perf_counter() - t0) * 1e3
        self.lane_steps += 1
        if not self._write(dest, sf.lane_frame(prefix, tail, ms, t_in, out), "step"):
            self.close_conn(dest, "broken while sending")
        self.store.add_run(ms, sess)  # (the bookkeeping after the send)
        return True

    def _step(self, sock: socket.socket, msg: m.Forward, t_in: float) -> None:
        try:
            stage = check_forward(self.store, msg, *self.inbound[sock])
        except EdgeliteError as exc:  # the sender gets the refusal, the connection stays
            self.bad_frames += 1
            log.info("forward refused: %s", exc)
            self.send(sock, m.Result(plan_id=msg.plan_id, session=msg.session, step=msg.step,
                                     start=msg.start, error=f"{self.name}: {exc}"))
            return
        if sock not in self.lanes:  # its later decode steps may take the lane
            self.lanes[sock] = (stage, msg.plan_id.encode())
        key = (msg.plan_id, msg.session)
        why = self.unrestored.pop(key, None)
        if why is None and (key in self.store.restoring or key in self.waiting):  # still read
            waiting = self.waiting.setdefault(key, [])
            if len(waiting) < self.cfg.max_waiting_steps:
                waiting.append(Ready(sock, msg, t_in, stage))
                return
            why = f"{len(waiting)} steps wait for its KV to be restored already (max_waiting_steps)"
        if why is not None and msg.error is None:
            self._pass_on(stage, msg, None, f"{self.name}: session {msg.session[:12]}: {why}", 0.0, t_in)
            return
        self.ready.append(Ready(sock, msg, t_in, stage))

    @property
    def steps_waiting(self) -> int:
        """Steps waiting for their sessions' KV to be restored (read from the event loop: one
        snapshot of the table)."""
        return sum(len(w) for w in list(self.waiting.values()))

    def reserve(self, stage: Stage, session: str, n: int) -> Slot:
        """A slot for the session's KV to be read into from the KV store (StageStore.reserve);
        its steps wait for it from now on."""
        self.unrestored.pop((stage.plan_id, session), None)
        return self.store.reserve(stage, session, n)

    def end(self, plan_id: str, session: str) -> int:
        """End a session (on this thread, after its steps read so far): its KV, and what is
        remembered of a restore of it. Returns the bytes freed."""
        self.unrestored.pop((plan_id, session), None)
        return self.store.end(plan_id, session)

    def restored(self, stage: Stage, session: str, slot: Slot, length: int | None) -> int:
        """A restore's end, on this thread: the slot, filled with `length` positions, becomes
        the session's, or (length None: the entry failed its checks) is freed. The session's
        steps that waited for it then run, or fail with the reason. Returns the length."""
        waiting = self.waiting.pop((stage.plan_id, session), [])
        error = None
        if length is None:
            self.store.abandon(stage, session, slot)
            error = "its KV could not be read from this node's KV store after all"
        else:
            try:
                self.store.attach(stage, session, slot, length)
            except EdgeliteError as exc:
                error = str(exc)
        if error is not None and not waiting:
            self.unrestored[stage.plan_id, session] = error
            while len(self.unrestored) > self.cfg.max_unrestored_kept:
                del self.unrestored[next(iter(self.unrestored))]
        for r in waiting:
            if error is None:
                self.ready.append(r)
            else:
                self._pass_on(r.stage, r.msg, None, f"{self.name}: session {session[:12]}: {error}",
                              0.0, r.t_in)
        if error is not None and length is not None:
            raise EdgeliteError(error)
        return length or 0

    def on_idle(self) -> None:
        """Run the steps read this round: decode steps on one layer range together (of one
        plan, or of several clients' plans of one model; up to the batch size, in `waves`),
        everything else one by one, in arrival order otherwise. A step never joins a batch
        ahead of an earlier step of its own session (a prompt's last chunk may be one token:
        it must not run before the chunks it follows)."""
        halved: set[str] = set()  # sessions of a wave split off this round
        while self.ready:
            first = self.ready.pop(0)
            group, rest = [first], []
            waiting: set[str] = set()  # sessions with an earlier step left for later
            for r in self.ready:
                if (first.decode and r.decode and r.stage.layers is first.stage.layers
                        and first.stage.layers.batchable
                        and len(group) < self.cfg.batch_max_steps
                        and r.msg.session not in waiting
                        and all(g.msg.session != r.msg.session for g in group)):
                    group.append(r)
                else:
                    rest.append(r)
                    waiting.add(r.msg.session)
            group, back = waves(self.store, group, self.cfg.wave_split_min, halved)
            self.ready = back + rest
            if len(group) == 1:
                self._forward(first.stage, first.msg, first.t_in)
            else:
                self._forward_batch(group)

    def _forward_batch(self, group: list[Ready]) -> None:
        """Run and pass on decode steps of several sessions on one layer range (of one plan,
        or of several clients' plans sharing the range): those whose KV slots share a slab
        run as one batch (weights read once, KV in place); a step its session refuses (wrong
        start, no KV budget) gets its own answer."""
        by_slab: dict[int, list[tuple[Ready, Session]]] = {}
        for r in group:
            try:
                sess = self.store.prepare(r.stage, r.msg.session, r.msg.start, 1)
            except EdgeliteError:
                self._forward(r.stage, r.msg, r.t_in)  # answers with the refusal
                continue
            by_slab.setdefault(id(sess.slot.slab), []).append((r, sess))
        for members in by_slab.values():
            if len(members) == 1:
                self._forward(members[0][0].stage, members[0][0].msg, members[0][0].t_in)
                continue
            hidden = np.concatenate([r.msg.hidden for r, _ in members])  # type: ignore[misc]
            self.store.gather([s for _, s in members])  # (once per wave: it stays together)
            try:
                outs, ms = self.store.compute_batch([s for _, s in members], hidden)
            except (EdgeliteError, RuntimeError, ValueError) as exc:
                log.warning("a batch of %d steps failed: %s", len(members), exc)
                for r, _ in members:
                    self._pass_on(r.stage, r.msg, None, f"{self.name}: {exc}", 0.0, r.t_in)
                continue
            self.batches += 1
            self.batched_steps += len(members)
            # each plan's sent in one write: its next stage (or client) reads them as one batch
            held: dict[str, tuple[Stage, list[m.Forward | m.Result]]] = {}
            for (r, _), out in zip(members, outs, strict=True):
                self._pass_on(r.stage, r.msg, out[None], None, ms, r.t_in,
                              held.setdefault(r.stage.plan_id, (r.stage, []))[1])
            for stage, outs_of_plan in held.values():
                self._send_all(stage, outs_of_plan)

    def _forward(self, stage: Stage, msg: m.Forward, t_in: float) -> None:
        """Run the step and pass it on (an upstream error or a refusal is passed on as such)."""
        ms, result, error = 0.0, None, msg.error
        if error is None:
            try:
                assert msg.hidden is not None  # check_forward
                sess = self.store.prepare(stage, msg.session, msg.start, msg.hidden.shape[1])
                result, ms = self.store.compute(sess, msg.hidden)
            except (EdgeliteError, RuntimeError, ValueError) as exc:  # onnxruntime: RuntimeError
                log.info("plan %s session %s: %s", msg.plan_id, msg.session[:12], exc)
                error = f"{self.name}: {exc}"
        self._pass_on(stage, msg, result, error, ms, t_in)

    def _pass_on(self, stage: Stage, msg: m.Forward, hidden: np.ndarray | None, error: str | None,
                 ms: float, t_in: float, held: list[m.Forward | m.Result] | None = None) -> None:
        """Send the step's outcome onward (or add it to `held`, to go with others)."""
        # what this stage adds to the step's time: running its layers, all its handling
        trace = [*msg.trace, (round(ms * 1e3), round((time.perf_counter() - t_in) * 1e6))]
        kind = m.Forward if stage.next_addr else m.Result
        out = kind(plan_id=msg.plan_id, session=msg.session, step=msg.step, start=msg.start,
                   hidden=hidden, error=error, trace=trace)
        if held is not None:
            held.append(out)
        else:
            self._send_all(stage, [out])

    def _send_all(self, stage: Stage, outs: list[m.Forward | m.Result]) -> None:
        """Steps of one plan onward, in one write."""
        if not outs:
            return
        plan_id = outs[0].plan_id
        dest = (self.outbound if stage.next_addr else self.sinks).get(plan_id)
        if dest is None:
            log.warning("plan %s: no connection onward; %d step(s) dropped", plan_id, len(outs))
        elif not self.send(dest, *outs):
            self.close_conn(dest, "broken while sending")


def waves(store: StageStore, group: list[Ready], split_min: int, halved: set[str]
          ) -> tuple[list[Ready], list[Ready]]:
    """A batch to run now, and the steps left for later this round: from `split_min` steps on,
    a batch of more than half of its range's sessions runs as two waves (`halves`), the second
    after the first is passed on; a wave split off (its sessions in `halved`, which this adds
    to) stays whole, here and at the stages after this one."""
    if len(group) < split_min or split_min <= 0 or all(g.msg.session in halved for g in group):
        return group, []
    layers = group[0].stage.layers
    with store.lock:
        opened = sum(1 for s in store.sessions.values() if s.stage.layers is layers)
    if 2 * len(group) <= opened:
        return group, []
    group, back = halves(store, group)
    halved.update(r.msg.session for r in back)
    return group, back


def halves(store: StageStore, group: list[Ready]) -> tuple[list[Ready], list[Ready]]:
    """A batch's two waves (wave_split_min), each of sessions with neighbouring KV slots:
    a batch runs over the span of its slots, and a wave once formed stays one (its
    results reach the client together, and its next steps leave together)."""
    def place(r: Ready) -> tuple[int, int]:
        sess = store.sessions.get((r.stage.plan_id, r.msg.session))
        return (0, -1) if sess is None else (id(sess.slot.slab), sess.slot.index)

    group = sorted(group, key=place)
    half = (len(group) + 1) // 2
    return group[:half], group[half:]
