"""`edgelite serve`: many users' requests through one model, ordered by the scheduler.

Clients speak the wire protocol and authenticate as a user from users.json (HMAC with that
user's own token); the user's tier comes from the file, never from the client. A request is a
GenerateRequest (messages or a prompt, and its own sampling settings); the gateway streams
TokenPiece frames and ends with Done or an Error.

Each client connection has its own writer task fed through a bounded queue: the scheduling loop
never waits on a client's socket, so a client that stops reading holds up nobody (it is dropped
once its queue is full or a send stalls). A client's requests end when it disconnects.

Each scheduler step becomes backend calls: admitted requests prefill their prompt, resumed ones
import the KV they were preempted with from the KV stores (`swap_preempted`: it was stored when
they were preempted) and compute what the stores lack, running ones decode one token; all of a
step's calls go through the pipeline at once. A prompt is prefilled `prefill_chunk_tokens` at a
time, one chunk per step, so a long prompt shares the pipeline with everyone else's decode steps
instead of stalling their streams.

A client that disconnects, or sends `generate_cancel` for one of its requests, has them
cancelled (queued ones are never prefilled). When a node is lost (e.g. it restarted), every
running request keeps its tokens and goes back to the queue; the gateway deploys the plan
again (every `reconnect_interval_s` until the nodes are back) and the requests resume where
they were.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import secrets
import statistics
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edgelite.config import GatewayConfig, GenerationConfig, WireLimits
from edgelite.engine.generate import Backend, stored_kv_failed
from edgelite.engine.sampling import sample
from edgelite.engine.tokenizer import StreamDecoder, Tokenizer
from edgelite.errors import AuthError, EdgeliteError, ProtocolError, QueueFull, StreamError
from edgelite.ids import SessionId, new_session_id
from edgelite.net import messages as m
from edgelite.net.frames import Conn, bound_port, listen
from edgelite.net.handshake import server_handshake
from edgelite.net.schema import Message
from edgelite.serve.scheduler import Decision, Request, Scheduler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class User:
    name: str
    token: str
    tier: int


def load_users(path: Path) -> dict[str, User]:
    """users.json: {"users": [{"name", "token", "tier"}]} (tier 0 = lowest)."""
    try:
        raw = json.loads(path.read_text())
        users = [User(str(u["name"]), str(u["token"]), int(u["tier"])) for u in raw["users"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EdgeliteError(f"{path}: not a users file ({exc!r}); expected "
                            f'{{"users": [{{"name", "token", "tier"}}]}}') from exc
    if any(u.tier < 0 for u in users) or len({u.name for u in users}) != len(users):
        raise EdgeliteError(f"{path}: user names must be unique and tiers >= 0")
    return {u.name: u for u in users}


class Sink(Protocol):
    """Where a request's frames go: a wire client, or an HTTP request (`serve/http.py`).
    `gone` set: its requests are cancelled at the next step."""

    user: User
    peer: str
    gone: bool

    def post(self, msg: Message) -> None: ...


class Client:
    """One connected client: its user, and a bounded queue of frames its writer task sends."""

    def __init__(self, conn: Conn, user: User, cfg: GatewayConfig) -> None:
        self.conn, self.user, self.cfg = conn, user, cfg
        self.peer = conn.peer
        self.queue: asyncio.Queue[Message | None] = asyncio.Queue(cfg.client_queue_frames)
        self.gone = False
        self.refused = 0  # requests refused in a row (a flood is disconnected)
        self.closing = False  # the writer sends what is queued, then the connection ends

    def post(self, msg: Message) -> None:
        """Queue a frame without waiting; a client this far behind is dropped."""
        if self.gone:
            return
        try:
            self.queue.put_nowait(msg)
        except asyncio.QueueFull:
            log.warning("%s (%s) reads nothing: %d frames queued; dropping the client",
                        self.conn.peer, self.user.name, self.queue.qsize())
            self.drop()

    def drop(self) -> None:
        self.gone = True
        self.conn.writer.close()

    def finish(self, last: Message) -> None:
        """Send `last` after what is queued, then end the connection (the writer's last act)."""
        self.post(last)
        self.closing = True
        with contextlib.suppress(asyncio.QueueFull):
            self.queue.put_nowait(None)

    async def write(self) -> None:
        """The writer task: send queued frames; a send that stalls drops the client."""
        while not self.gone:
            msg = await self.queue.get()
            if msg is None:
                return
            try:
                await asyncio.wait_for(self.conn.send(msg), self.cfg.client_send_timeout_s)
            except (TimeoutError, ConnectionError, OSError):
                log.info("%s: a send stalled or failed; dropping the client", self.conn.peer)
                self.drop()


@dataclass(eq=False)
class Job:
    """One client request: the scheduler's Request plus what the gateway needs to serve it."""

    req: Request
    client: Sink
    rid: int
    prompt: list[int]
    gen: GenerationConfig
    decoder: StreamDecoder
    session: SessionId = field(default_factory=new_session_id)
    tokens: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # what its (re)prefill has still to send
    swapped: int = 0  # tokens whose KV it stored when it was last preempted
    restored: int = 0  # tokens imported at its last swap-in that no step has confirmed yet
    reused: bool = False  # those tokens are a stored prefix of its prompt (not its own swap)
    prefill_waits: int = 0  # steps in a row its prefill was left out (over the step's budget)
    cancelled: bool = False  # its client said stop (generate_cancel): dropped at the next step
    token_times: list[float] = field(default_factory=list)
    rng: np.random.Generator = field(default_factory=np.random.default_rng)


@dataclass
class TierStats:
    window: int
    ttft_ms: deque[float] = field(init=False)
    itl_ms: deque[float] = field(init=False)
    preemptions: int = 0
    done: int = 0

    def __post_init__(self) -> None:
        self.ttft_ms, self.itl_ms = deque(maxlen=self.window), deque(maxlen=self.window)

    def to_json(self) -> dict[str, Any]:
        def pct(xs: deque[float], q: float) -> float:
            return round(float(np.percentile(xs, q)), 2) if xs else 0.0

        return {"done": self.done, "preemptions": self.preemptions,
                "ttft_ms_p50": pct(self.ttft_ms, 50), "ttft_ms_p99": pct(self.ttft_ms, 99),
                "itl_ms_p50": pct(self.itl_ms, 50), "itl_ms_p99": pct(self.itl_ms, 99),
                "itl_ms_mean": round(statistics.fmean(self.itl_ms), 2) if self.itl_ms else 0.0}


class Gateway:
    def __init__(self, backend: Backend, tok: Tokenizer, users: dict[str, User],
                 scheduler: Scheduler, cfg: GatewayConfig | None = None,
                 defaults: GenerationConfig | None = None, limits: WireLimits | None = None) -> None:
        self.backend, self.tok, self.users, self.sched = backend, tok, users, scheduler
        self.cfg, self.limits = cfg or GatewayConfig(), limits or WireLimits()
        self.defaults = defaults or GenerationConfig()  # for what a request does not say
        self.jobs: dict[str, Job] = {}  # scheduler rid -> job
        self.tiers: dict[int, TierStats] = {}
        self.wake = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.eos = set(backend.manifest.eos_token_ids)
        self.cancelled = 0  # requests of clients that left before they finished
        # tokens of resumed requests whose KV came back from the stores, and that were computed
        self.swapped_tokens = self.recomputed_tokens = 0
        self.reused_tokens = 0  # prompt tokens whose KV came from a stored prefix (reuse_prefixes)
        self.cooldown: dict[str, float] = {}  # user -> when it may connect again (after a flood)
        self.floods = 0
        self.reconnects = 0  # times the plan was deployed again after a lost node
        self.rejoins = 0  # times nodes a recovery left out were planned in again
        self.reconnect_failures = 0
        self.tokens_total = 0  # tokens streamed to every client since the start
        self.token_times: deque[float] = deque(maxlen=self.cfg.latency_window)  # the latest
        # finished requests' KV being stored, then freed (reuse_prefixes): tasks that run
        # beside the steps, not in the way of the other requests' tokens
        self.finishing: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        return bound_port(self.server)

    async def start(self) -> None:
        self.server = await listen(self._handle, self.cfg.host, self.cfg.port)

    async def run(self) -> None:
        """The scheduling loop; the native port, if `start` opened it, serves meanwhile and is
        closed on the way out."""
        try:
            await self._loop()
        finally:
            for t in self.finishing:
                t.cancel()
            await asyncio.gather(*self.finishing, return_exceptions=True)
            if self.server is not None:
                self.server.close()

    # ---- clients -------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = "{}:{}".format(*writer.get_extra_info("peername")[:2])
        conn = Conn(reader, writer, self.limits, peer)
        client: Client | None = None
        try:
            auth = await asyncio.wait_for(
                server_handshake(conn, self._secret, "edgelite-gateway",
                                 [self.backend.manifest.fingerprint]), self.cfg.handshake_timeout_s)
            client = Client(conn, self.users[str(auth.user)], self.cfg)
            writing = asyncio.get_running_loop().create_task(client.write(), name=f"to {peer}")
            try:
                await self._read(client)
                if client.closing:  # its last frames go out first (bounded by the send timeout)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(writing), self.cfg.client_send_timeout_s)
            finally:
                writing.cancel()
                await asyncio.gather(writing, return_exceptions=True)
        except (AuthError, ProtocolError) as exc:
            log.warning("%s: %s; closing", peer, exc)
            with contextlib.suppress(ConnectionError, OSError):
                await conn.send(m.Error(message=str(exc)))
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            log.debug("%s: connection ended: %r", peer, exc)
        finally:
            if client is not None:
                client.gone = True  # the scheduling loop cancels its requests
                self.wake.set()
            await conn.close()

    async def _read(self, client: Client) -> None:
        while not client.gone:
            frame: dict[str, Any] = {}
            try:
                try:
                    frame = await asyncio.wait_for(client.conn.recv_frame(), self.cfg.idle_timeout_s)
                except asyncio.IncompleteReadError:
                    return
                msg = m.parse(frame, self.limits)
                if isinstance(msg, m.GatewayStatsRequest):
                    client.post(m.GatewayStats(id=msg.id, stats=self.stats()))
                elif isinstance(msg, m.GenerateRequest):
                    self._submit(client, msg)
                elif isinstance(msg, m.GenerateCancel):
                    self._cancel(client, msg.id)
                else:
                    raise ProtocolError(f"{msg.TYPE} is not a gateway request")
            except StreamError:
                raise  # the stream cannot be followed: the client goes
            except EdgeliteError as exc:  # a bad request: refused, the connection stays
                rid = m.reply_id(frame)
                client.post(m.Error(message=str(exc), id=rid))
                client.refused += 1
                if client.refused > self.cfg.max_refused_in_a_row:
                    self._flooded(client)
                    return
            else:
                client.refused = 0

    def _flooded(self, client: Client) -> None:
        """A client whose requests keep being refused is cut off, and its user may not connect
        again for `flood_cooldown_s` (a flood costs one handshake per cooldown, no more)."""
        name = client.user.name
        self.cooldown[name] = time.monotonic() + self.cfg.flood_cooldown_s
        self.floods += 1
        log.warning("%s (%s): %d requests refused in a row; disconnected, the user may "
                    "reconnect in %g s", client.conn.peer, name, client.refused,
                    self.cfg.flood_cooldown_s)
        client.finish(m.Error(message=f"{client.refused} requests refused in a row; disconnected "
                                      f"for {self.cfg.flood_cooldown_s:g} s"))

    def _cancel(self, client: Client, rid: int) -> None:
        """The client stops one of its own requests (unknown or finished ids: nothing to do; a
        client never reaches another's requests)."""
        for job in self.jobs.values():
            if job.client is client and job.rid == rid:
                job.cancelled = True
                self.wake.set()

    def _secret(self, auth: m.Auth) -> str | None:
        """The user's token (None: unknown user); a user cooling down after a flood is refused
        before the handshake completes."""
        user = self.users.get(auth.user) if auth.user is not None else None
        if user is None:
            return None
        wait = self.cooldown.get(user.name, 0.0) - time.monotonic()
        if wait > 0:
            raise AuthError(f"user {user.name} sent a flood of refused requests; it may connect "
                            f"again in {wait:.1f} s")
        return user.token

    def _submit(self, client: Client, msg: m.GenerateRequest) -> None:
        d = self.defaults
        self.submit(client, msg.id, self._prompt(msg), GenerationConfig(
            max_tokens=msg.max_tokens if msg.max_tokens is not None else d.max_tokens,
            seed=msg.seed if msg.seed is not None else d.seed,
            temperature=msg.temperature if msg.temperature is not None else d.temperature,
            top_p=msg.top_p if msg.top_p is not None else d.top_p))

    def submit(self, sink: Sink, rid: int, prompt: list[int], gen: GenerationConfig) -> None:
        """Queue a request: its pieces, then Done or Error (with id `rid`), go to `sink`.
        Raises ProtocolError for a request out of bounds, QueueFull when its user has
        `max_requests_per_user` already."""
        user = sink.user
        if gen.max_tokens > self.cfg.max_tokens_limit:
            raise ProtocolError(f"max_tokens must be at most {self.cfg.max_tokens_limit}")
        mine = sum(1 for j in self.jobs.values() if j.client.user is user)
        if mine >= self.cfg.max_requests_per_user:
            raise QueueFull(f"user {user.name} has {mine} requests queued or running; the "
                            f"limit is {self.cfg.max_requests_per_user}")
        req = Request(new_session_id(), user.tier, len(prompt), gen.max_tokens, time.monotonic(),
                      user=user.name)
        try:
            self.sched.submit(req)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from exc
        rng = np.random.default_rng(gen.seed if gen.seed is not None else secrets.randbits(64))
        self.jobs[req.rid] = Job(req, sink, rid, prompt, gen, StreamDecoder(self.tok), rng=rng)
        self.wake.set()

    @property
    def ready(self) -> bool:
        """Requests can run now (the plan is deployed and every node answers)."""
        return self.backend.healthy

    def _prompt(self, msg: m.GenerateRequest) -> list[int]:
        if msg.messages is not None:
            chat = [{"role": c.role, "content": c.content} for c in msg.messages]
        elif msg.prompt is not None:
            chat = [{"role": "user", "content": msg.prompt}]
        else:
            raise ProtocolError("generate needs messages [{role, content}] or a prompt string")
        size = sum(len(c["content"]) for c in chat)
        if size > self.cfg.max_prompt_chars:
            raise ProtocolError(f"prompt of {size} characters exceeds {self.cfg.max_prompt_chars}")
        return self.tok.chat_prompt(chat)

    # ---- the scheduling loop -------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            await self._cancel_gone()
            if not self.backend.healthy:
                await self._recover()
                continue
            rejoin = getattr(self.backend, "rejoin", None)  # (a failover backend's)
            if rejoin is not None and await rejoin() is not None:  # nodes left out are back
                self.rejoins += 1
            d = self.sched.step(time.monotonic())
            for r in d.preempt:
                if r.queue == "waiting":  # put back for fair shares (not a preemption)
                    log.info("%s (user %s) gives its slot back to another user after %d tokens",
                             r.rid[:12], r.user, r.generated)
                    continue
                self._tier(self.jobs[r.rid]).preemptions += 1
                log.info("preempted %s (tier %d, user %s) after %d tokens", r.rid[:12], r.tier,
                         r.user, r.generated)
            ends = [self._swap_out(self.jobs[r.rid]) for r in d.preempt]  # alongside this step's work
            if d.idle:
                await asyncio.gather(*ends)
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), self.cfg.idle_poll_s)
                continue
            back, new = [], []  # requests that ran before (preempted, or put back for fair shares)
            for r in (*d.admit, *d.resume):
                job = self.jobs[r.rid]
                job.pending = job.prompt + job.tokens
                (back if job.tokens or job.swapped else new).append(job)
            looking: list[Coroutine[Any, Any, None]] = []
            if new and self.cfg.reuse_prefixes:
                if self.finishing:  # a new prompt may extend one being stored now: stored first
                    await asyncio.wait(set(self.finishing), timeout=self.cfg.store_wait_s)
                # new requests look for a stored prefix alongside this step (the others'
                # tokens do not wait for the lookup); they join the steps from the next one
                looking = [self._reuse(job) for job in new]
            await asyncio.gather(*(self._swap_in(job) for job in back))
            skip = {job.req.rid for job in new} if looking else set()
            work = [(r, self._next_ids(self.jobs[r.rid])) for r in self._this_step(d)
                    if r.rid not in skip]
            results = await asyncio.gather(
                *ends, *looking, *(self.backend.step(self.jobs[r.rid].session, np.array([ids], np.int64))
                                   for r, (ids, _) in work), return_exceptions=True)
            for x in results[len(ends):len(ends) + len(looking)]:
                if isinstance(x, BaseException):
                    raise x  # (_reuse handles what a lookup may meet: this is a bug)
            results = results[len(ends) + len(looking):]
            lost = not self.backend.healthy
            for (r, (_, last)), logits in zip(work, results, strict=True):
                if lost and isinstance(logits, BaseException):
                    continue  # the request goes back to the queue (_recover)
                job = self.jobs[r.rid]
                if job.restored and stored_kv_failed(logits):
                    await self._unswap(job, logits)
                    continue
                job.restored = 0
                if last or isinstance(logits, BaseException):
                    await self._deliver(job, logits)

    def _this_step(self, d: Decision) -> list[Request]:
        """The requests that run this step: every decoding one, and prefill chunks up to
        `prefill_step_tokens` (at least one chunk), the shortest remaining prefill first, a
        prefill left out for steps gaining a chunk's worth each step. So a long prompt, or a
        long conversation recomputed after a preemption, costs others' decode steps at most
        one budget, and a short prompt is not queued behind it."""
        chunk = self.cfg.prefill_chunk_tokens
        decoding, prefilling = [], []
        for r in (*d.admit, *d.resume, *d.decode):
            (prefilling if self.jobs[r.rid].pending else decoding).append(r)
        prefilling.sort(key=lambda r: len(self.jobs[r.rid].pending) - chunk * self.jobs[r.rid].prefill_waits)
        budget = self.cfg.prefill_step_tokens
        for k, r in enumerate(prefilling):
            job = self.jobs[r.rid]
            size = min(chunk, len(job.pending))
            if k == 0 or size <= budget:
                budget -= size
                job.prefill_waits = 0
                decoding.append(r)
            else:
                job.prefill_waits += 1
        return decoding

    def _next_ids(self, job: Job) -> tuple[list[int], bool]:
        """What a request sends this step: the next chunk of its prefill, or its last token;
        and whether the result gives its next token."""
        if job.pending:
            chunk = job.pending[:self.cfg.prefill_chunk_tokens]
            del job.pending[:len(chunk)]
            return chunk, not job.pending
        return job.tokens[-1:], True

    async def _swap_out(self, job: Job) -> None:
        """A preempted request gives its KV up: stored first (`swap_preempted`), then freed."""
        if self.cfg.swap_preempted:
            full = job.prompt + job.tokens
            held = full[:len(full) - (len(job.pending) if job.pending else 1)]
            try:
                if await self.backend.save(job.session, held, behind=True):
                    job.swapped = len(held)
            except EdgeliteError as exc:
                log.info("%s: its KV was not stored (%s); it will be recomputed", job.req.rid[:12], exc)
        await self._end(job)

    async def _swap_in(self, job: Job) -> None:
        """A resumed request imports the KV it was preempted with; the rest is computed."""
        n = 0
        if job.swapped:
            try:
                n = await self.backend.restore(job.session, job.pending[:-1])
            except EdgeliteError as exc:
                log.info("%s: its stored KV is not usable (%s)", job.req.rid[:12], exc)
        self.swapped_tokens += n
        self.recomputed_tokens += len(job.pending) - 1 - n
        del job.pending[:n]
        job.swapped, job.restored, job.reused = 0, n, False

    async def _reuse(self, job: Job) -> None:
        """A new request imports the KV of the longest stored prefix of its prompt
        (`reuse_prefixes`); the rest is computed."""
        n = 0
        if self.cfg.reuse_prefixes and len(job.pending) > 1:
            try:
                n = await self.backend.restore(job.session, job.pending[:-1])
            except EdgeliteError as exc:
                log.info("%s: no stored prefix used (%s)", job.req.rid[:12], exc)
        self.reused_tokens += n
        del job.pending[:n]
        job.restored, job.reused = n, n > 0

    async def _unswap(self, job: Job, exc: BaseException) -> None:
        """A node could not read the KV it had found for a resumed request, or for a new one's
        prompt, after all (its first step failed): the request computes it instead."""
        log.info("%s: its stored KV was not usable after all (%s); it is recomputed",
                 job.req.rid[:12], exc)
        await self._end(job)
        job.pending = job.prompt + job.tokens
        if job.reused:
            self.reused_tokens -= job.restored
        else:
            self.swapped_tokens -= job.restored
            self.recomputed_tokens += job.restored
        job.restored, job.reused = 0, False

    async def _end(self, job: Job) -> None:
        """Free a request's KV on the nodes (best effort: a lost node has freed it anyway)."""
        try:
            await self.backend.end(job.session)
        except EdgeliteError as exc:
            log.debug("ending %s: %s", job.req.rid[:12], exc)

    async def _cancel_gone(self) -> None:
        """Cancel the requests of clients that went away or said stop: queued ones are never
        prefilled, running ones free their KV now."""
        ends = []
        for job in [j for j in self.jobs.values() if j.client.gone or j.cancelled]:
            log.info("cancelled %s of %s (%s), who left after %d tokens", job.req.rid[:12],
                     job.client.peer, job.req.queue, len(job.tokens))
            if job.req.queue == "running":
                ends.append(self._end(job))
            self.sched.cancel(job.req)
            del self.jobs[job.req.rid]
            self.cancelled += 1
        await asyncio.gather(*ends)

    async def _recover(self) -> None:
        """A node was lost: running requests go back to the queue (their tokens kept), and the
        plan is deployed again until that works."""
        back = self.sched.lost_kv()
        if back:
            log.warning("a node was lost; %d running requests wait to resume", len(back))
        try:
            await self.backend.reopen()
        except EdgeliteError as exc:
            self.reconnect_failures += 1
            log.warning("deploying the plan again failed (%s); retrying in %g s", exc,
                        self.cfg.reconnect_interval_s)
            await asyncio.sleep(self.cfg.reconnect_interval_s)
            return
        self.reconnects += 1
        log.info("the plan is deployed again; %d requests resume", len(back))

    async def _deliver(self, job: Job, logits: np.ndarray | BaseException) -> None:
        r = job.req
        if job.client.gone or job.cancelled:
            return  # cancelled at the top of the next round
        if isinstance(logits, BaseException):
            if not isinstance(logits, EdgeliteError):
                raise logits
            log.warning("request %s failed: %s", r.rid[:12], logits)
            self.sched.advance(r, done=True)
            await self._finish(job, error=str(logits))
            return
        tok = sample(logits, job.gen.temperature, job.gen.top_p, job.rng)
        eos = tok in self.eos
        if not eos:
            job.tokens.append(tok)
            job.token_times.append(time.monotonic())
            self.tokens_total += 1
            self.token_times.append(job.token_times[-1])
            job.client.post(m.TokenPiece(id=job.rid, text=job.decoder.push(tok), token_id=tok))
        self.sched.advance(r, done=eos, keep_kv=self.cfg.reuse_prefixes)  # (until stored: _finish)
        if r.queue == "finished":
            await self._finish(job, finish="eos" if eos else "length")

    async def _finish(self, job: Job, error: str | None = None, finish: str = "length") -> None:
        del self.jobs[job.req.rid]
        if error is None and self.cfg.reuse_prefixes:  # its KV, for the next that shares it
            fed = job.prompt + (job.tokens if finish == "eos" else job.tokens[:-1])
            task = asyncio.create_task(self._store_and_end(job, fed), name=f"store {job.req.rid[:12]}")
            self.finishing.add(task)
            task.add_done_callback(self._stored)
        else:
            await self._end(job)
        st = self._tier(job)
        t = job.token_times
        if t:
            st.ttft_ms.append((t[0] - job.req.arrival) * 1e3)
            st.itl_ms.extend(float(x) * 1e3 for x in np.diff(t))
        st.done += 1
        if error is not None:
            job.client.post(m.Error(message=error, id=job.rid))
            return
        job.client.post(m.Done(
            id=job.rid, token_ids=job.tokens, tier=job.client.user.tier, finish=finish,
            ttft_ms=round((t[0] - job.req.arrival) * 1e3, 2) if t else None,
            preemptions=job.req.preemptions,
            decode_tok_s=round((len(t) - 1) / (t[-1] - t[0]), 2) if len(t) > 1 and t[-1] > t[0] else 0.0))

    async def _store_and_end(self, job: Job, fed: list[int]) -> None:
        """A finished request's KV into the stores (copied, written behind), then freed: on
        the nodes, and in the scheduler's count (which held it meanwhile: no admission takes
        KV the nodes still hold)."""
        try:
            await self.backend.save(job.session, fed, behind=True)
        except EdgeliteError as exc:
            log.info("%s: its KV was not stored (%s)", job.req.rid[:12], exc)
        finally:
            try:
                await self._end(job)
            finally:
                self.sched.release(job.req)

    def _stored(self, task: asyncio.Task[None]) -> None:
        self.finishing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("storing a finished request's KV failed: %r", task.exception())

    def _tier(self, job: Job) -> TierStats:
        return self.tiers.setdefault(job.client.user.tier, TierStats(self.cfg.latency_window))

    def tokens_per_s(self) -> float:
        """Tokens streamed per second over the last `rate_window_s`."""
        since = time.monotonic() - self.cfg.rate_window_s
        recent = sum(1 for _ in itertools.takewhile(lambda t: t >= since, reversed(self.token_times)))
        return round(recent / self.cfg.rate_window_s, 2)

    def stats(self) -> dict[str, Any]:
        s = self.sched
        queues = {"waiting": s.waiting(), "running": s.running, "preempted": s.preempted_list()}
        tiers = {0} | {u.tier for u in self.users.values()} | {
            r.tier for rs in queues.values() for r in rs}
        per_tier = {str(t): {q: sum(1 for r in rs if r.tier == t) for q, rs in queues.items()}
                    for t in sorted(tiers)}
        return {"queues": {q: len(rs) for q, rs in queues.items()}, "queues_by_tier": per_tier,
                "cancelled": self.cancelled, "floods": self.floods, "reconnects": self.reconnects,
                "rejoins": self.rejoins,
                # recoveries without a node (planned again without it; a failover backend's)
                "recoveries": len(getattr(self.backend, "recoveries", ())),
                "reconnect_failures": self.reconnect_failures,
                "kv_tokens": {"used": s.kv_used, "budget": s.cfg.kv_tokens},
                "tokens_total": self.tokens_total, "tokens_per_s": self.tokens_per_s(),
                "preemptions": sum(st.preemptions for st in self.tiers.values()),
                "resumed_tokens": {"swapped_in": self.swapped_tokens,
                                   "recomputed": self.recomputed_tokens},
                "prompt_tokens_reused": self.reused_tokens,
                "tiers": {str(t): st.to_json() for t, st in sorted(self.tiers.items())}}
