"""`edgelite serve`: many users' requests through one model, ordered by the scheduler.

Requests come in through the front doors (`serve/native.py`, the wire protocol; `serve/http.py`,
the OpenAI API) as an `Ask` (`serve/ask.py`), which `submit` checks and queues; each request's
tokens come out of its own reply loop (`reply/loop.py`) and go to its door's `Sink` as
TokenPiece frames, ending with Done or an Error.

Each scheduler step becomes backend calls: admitted requests prefill their prompt, resumed ones
import the KV they were preempted with from the KV stores (`swap_preempted`: it was stored when
they were preempted) and compute what the stores lack, running ones decode one token; all of a
step's calls go through the pipeline at once. A prompt is prefilled `prefill_chunk_tokens` at a
time, one chunk per step, so a long prompt shares the pipeline with everyone else's decode steps
instead of stalling their streams.

A client that disconnects, or cancels one of its requests, has them cancelled (queued ones are
never prefilled). When a node is lost (e.g. it restarted), every running request keeps its
tokens and goes back to the queue; the gateway deploys the plan again (every
`reconnect_interval_s` until the nodes are back) and the requests resume where they were.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from edgelite.config import GatewayConfig, GenerationConfig
from edgelite.errors import EdgeliteError, QueueFull
from edgelite.ids import SessionId, new_session_id
from edgelite.net import messages as m
from edgelite.net.schema import Message
from edgelite.reply.backend import Backend, run, stored_kv_failed
from edgelite.reply.driver import Call, ReplyDriver
from edgelite.reply.embed import Pool
from edgelite.reply.loop import Piece, ReplyLoop, constrained, fitted
from edgelite.reply.speculate import Lookup, Pacer
from edgelite.reply.tokenizer import StreamDecoder, Tokenizer
from edgelite.serve.ask import Ask, AskError, check, generation
from edgelite.serve.figures import Figures
from edgelite.serve.scheduler import Decision, Request, Scheduler
from edgelite.serve.users import User

log = logging.getLogger(__name__)


class Sink(Protocol):
    """Where a request's frames go: a wire client, or an HTTP request (`serve/http.py`).
    `gone` set: its requests are cancelled at the next step."""

    user: User
    peer: str
    gone: bool

    def post(self, msg: Message) -> None: ...


@dataclass(eq=False)
class Job:
    """One client request: the scheduler's Request, its reply's driver (reply/driver.py: what
    the request sends next, what its session holds), and what the gateway needs to serve it."""

    req: Request
    client: Sink
    rid: int
    driver: ReplyDriver
    session: SessionId = field(default_factory=new_session_id)
    swapped: int = 0  # tokens whose KV it stored when it was last preempted
    reused: bool = False  # what it imported is a stored prefix of its prompt (not its own swap)
    prefill_waits: int = 0  # steps in a row its prefill was left out (over the step's budget)
    cancelled: bool = False  # its client said stop (generate_cancel): dropped at the next step
    tail: str = ""  # text its reply loop held back until the end (sent with Done)
    call: Call | None = None  # its call in this step
    pool: Pool | None = None  # an embedding's sums (Ask.embedding): its steps give hidden states

    @property
    def prompt(self) -> list[int]:
        return self.driver.prompt

    @property
    def reply(self) -> ReplyLoop:
        assert self.driver.reply is not None
        return self.driver.reply

    @property
    def tokens(self) -> list[int]:
        return self.driver.tokens

    def emit(self, piece: Piece) -> None:
        """A piece to the client (text held back to the end goes with Done)."""
        if piece.token_id is None:
            self.tail = piece.text
        else:
            self.client.post(m.TokenPiece(id=self.rid, text=piece.text, token_id=piece.token_id,
                                          logprob=piece.logprob, top_ids=[t for t, _ in piece.top],
                                          top_logprobs=[lp for _, lp in piece.top]))


class Gateway:
    def __init__(self, backend: Backend, tok: Tokenizer, users: dict[str, User],
                 scheduler: Scheduler, cfg: GatewayConfig | None = None,
                 defaults: GenerationConfig | None = None) -> None:
        self.backend, self.tok, self.users, self.sched = backend, tok, users, scheduler
        self.cfg = cfg or GatewayConfig()
        self.defaults = defaults or GenerationConfig()  # for what a request does not say
        self.jobs: dict[str, Job] = {}  # scheduler rid -> job
        self.figures = Figures(self.cfg)
        self.wake = asyncio.Event()
        self.eos = set(backend.manifest.eos_token_ids)
        # finished requests' KV being stored, then freed (reuse_prefixes): tasks that run
        # beside the steps, not in the way of the other requests' tokens
        self.finishing: set[asyncio.Task[None]] = set()
        self.pacer = Pacer()  # how many drafts speculating requests offer (learns as they run)
        self.tokenizing: Counter[str] = Counter()  # user -> its requests being tokenized

    async def run(self) -> None:
        """The scheduling loop, until cancelled."""
        try:
            await self._loop()
        finally:
            for t in self.finishing:
                t.cancel()
            await asyncio.gather(*self.finishing, return_exceptions=True)

    # ---- requests ------------------------------------------------------------------------
    async def submit(self, sink: Sink, rid: int, ask: Ask) -> None:
        """Check and queue a request: its pieces, then Done or Error (with id `rid`), go to
        `sink`. Raises AskError for a request out of bounds (serve/ask.py: the same rules for
        every door), QueueFull when its user has `max_requests_per_user` already."""
        check(ask, self.cfg)
        gen = generation(ask, self.defaults)
        if gen.max_tokens > self.cfg.max_tokens_limit:
            raise AskError(f"max_tokens must be within 1..{self.cfg.max_tokens_limit} (got "
                           f"{gen.max_tokens}, the server's default)", "max_tokens")
        user = sink.user
        mine = sum(1 for j in self.jobs.values() if j.client.user is user) + self.tokenizing[user.name]
        if mine >= self.cfg.max_requests_per_user:  # (before any work: a flood costs little)
            raise QueueFull(f"user {user.name} has {mine} requests queued or running; the "
                            f"limit is {self.cfg.max_requests_per_user}")
        self.tokenizing[user.name] += 1  # (counted while off the event loop)
        try:
            prompt = await prompt_of(self.tok, ask)
        finally:
            self.tokenizing[user.name] -= 1
        if not prompt:
            raise AskError("the prompt is empty", "prompt")
        m = self.backend.manifest
        try:
            gen = fitted(gen, len(prompt), min(m.max_positions, self.sched.cfg.context_limit), m,
                         "the context this server's nodes hold")
        except EdgeliteError as exc:
            raise AskError(str(exc), "messages" if ask.messages is not None else "prompt") from None
        req = Request(new_session_id(), user.tier, len(prompt),
                      1 if ask.embedding else gen.max_tokens, time.monotonic(), user=user.name)
        try:
            self.sched.submit(req)
        except ValueError as exc:
            raise AskError(str(exc), "messages" if ask.messages is not None else "prompt") from exc
        if ask.embedding:
            pool = Pool(m.hidden_size)
            driver = ReplyDriver(None, prompt, pool=pool)
        else:
            pool = None
            reply = ReplyLoop(gen, self.eos, StreamDecoder(self.tok), started=req.arrival, prompt=prompt)
            spec = gen.speculate == "lookup" and not constrained(gen)
            driver = ReplyDriver(reply, prompt, *((Lookup(), self.pacer.fork()) if spec else (None, None)))
        self.jobs[req.rid] = Job(req, sink, rid, driver, pool=pool)
        self.wake.set()

    def cancel(self, sink: Sink, rid: int) -> None:
        """A client stops one of its own requests (unknown or finished ids: nothing to do; a
        client never reaches another's requests)."""
        for job in self.jobs.values():
            if job.client is sink and job.rid == rid:
                job.cancelled = True
                self.wake.set()

    @property
    def ready(self) -> bool:
        """Requests can run now (the plan is deployed and every node answers)."""
        return self.backend.healthy

    # ---- the scheduling loop -------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            await self._cancel_gone()
            if not self.backend.healthy:
                await recover(self.sched, self.backend, self.figures, self.cfg)
                continue
            rejoin = getattr(self.backend, "rejoin", None)  # (a failover backend's)
            if rejoin is not None and await rejoin() is not None:  # nodes left out are back
                self.figures.rejoins += 1
            d = self.sched.step(time.monotonic())
            for r in d.preempt:
                if r.queue == "waiting":  # put back for fair shares (not a preemption)
                    log.info("%s (user %s) gives its slot back to another user after %d tokens",
                             r.rid[:12], r.user, r.generated)
                    continue
                self.figures.tier(r.tier).preemptions += 1
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
                job.driver.reset()  # (an embedding starts again: nothing of it is stored)
                if job.pool is None:
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
            chunk = self.cfg.prefill_chunk_tokens
            work = [self.jobs[r.rid] for r in this_step(d, self.jobs, self.cfg) if r.rid not in skip]
            calls = []
            for job in work:
                job.call = job.driver.next_call(chunk)
                calls.append(run(self.backend, job.session, job.call))
            t0 = time.perf_counter()
            results = await asyncio.gather(*ends, *looking, *calls, return_exceptions=True)
            paced(self.pacer, work, (time.perf_counter() - t0) * 1e3)
            for x in results[len(ends):len(ends) + len(looking)]:
                if isinstance(x, BaseException):
                    raise x  # (_reuse handles what a lookup may meet: this is a bug)
            results = results[len(ends) + len(looking):]
            lost = not self.backend.healthy
            for job, result in zip(work, results, strict=True):
                if lost and isinstance(result, BaseException):
                    continue  # the request goes back to the queue (_recover)
                if job.driver.restored and stored_kv_failed(result):
                    await self._unswap(job, result)
                    continue
                await self._deliver(job, result)

    async def _swap_out(self, job: Job) -> None:
        """A preempted request gives its KV up: stored first (`swap_preempted`), then freed."""
        if self.cfg.swap_preempted and job.pool is None:
            held = list(job.driver.fed)
            try:
                if await self.backend.save(job.session, held, behind=True):
                    job.swapped = len(held)
            except EdgeliteError as exc:
                log.info("%s: its KV was not stored (%s); it will be recomputed", job.req.rid[:12], exc)
        await self._end(job)

    async def _swap_in(self, job: Job) -> None:
        """A resumed request imports the KV it was preempted with; the rest is computed."""
        n, wanted = 0, job.driver.wanted()
        if job.swapped:
            try:
                n = await self.backend.restore(job.session, wanted)
            except EdgeliteError as exc:
                log.info("%s: its stored KV is not usable (%s)", job.req.rid[:12], exc)
        self.figures.swapped_tokens += n
        self.figures.recomputed_tokens += len(wanted) - n
        job.driver.imported(n)
        job.swapped, job.reused = 0, False

    async def _reuse(self, job: Job) -> None:
        """A new request imports the KV of the longest stored prefix of its prompt
        (`reuse_prefixes`); the rest is computed."""
        n, wanted = 0, job.driver.wanted()
        if self.cfg.reuse_prefixes and wanted:
            try:
                n = await self.backend.restore(job.session, wanted)
            except EdgeliteError as exc:
                log.info("%s: no stored prefix used (%s)", job.req.rid[:12], exc)
        self.figures.reused_tokens += n
        job.driver.imported(n)
        job.reused = n > 0

    async def _unswap(self, job: Job, exc: BaseException) -> None:
        """A node could not read the KV it had found for a resumed request, or for a new one's
        prompt, after all (its first step failed): the request computes it instead."""
        log.info("%s: its stored KV was not usable after all (%s); it is recomputed",
                 job.req.rid[:12], exc)
        await self._end(job)
        n = job.driver.unusable()
        if job.reused:
            self.figures.reused_tokens -= n
        else:
            self.figures.swapped_tokens -= n
            self.figures.recomputed_tokens += n
        job.reused = False

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
            self.figures.cancelled += 1
        await asyncio.gather(*ends)

    async def _deliver(self, job: Job, result: np.ndarray | BaseException) -> None:
        r = job.req
        if job.client.gone or job.cancelled:
            return  # cancelled at the top of the next round
        if isinstance(result, BaseException):
            if not isinstance(result, EdgeliteError):
                raise result
            log.warning("request %s failed: %s", r.rid[:12], result)
            self.sched.advance(r, done=True)
            await self._finish(job, error=str(result))
            return
        assert job.call is not None
        before = len(job.tokens)
        try:
            out = job.driver.took(job.call, result)
        except EdgeliteError as exc:  # (a reply that cannot go on: this request alone ends)
            log.warning("request %s failed: %s", r.rid[:12], exc)
            self.sched.advance(r, done=True)
            await self._finish(job, error=str(exc))
            return
        if job.pool is not None:  # an embedding: its chunk's states, the last ending it
            if job.driver.done:
                self.sched.advance(r, done=True)
                await self._finish(job)
            return
        if not job.call.gives:
            return  # a prefill chunk before the last
        for piece in out.pieces:
            if piece.token_id is not None:
                self.figures.token(job.reply.stats.token_times[-1])
            job.emit(piece)
        made = len(job.tokens) - before + (job.reply.finish == "eos")  # (EOS ends it: one more)
        advance(self.sched, r, made, job.reply.done, self.cfg.reuse_prefixes)
        if r.queue == "finished":
            await self._finish(job)
        elif out.rollback is not None:  # the stages give back the refused drafts' positions
            await self.backend.rollback(job.session, out.rollback)

    async def _finish(self, job: Job, error: str | None = None) -> None:
        del self.jobs[job.req.rid]
        reply = job.driver.reply
        if error is None and self.cfg.reuse_prefixes and job.pool is None:  # its KV, for reuse
            fed = list(job.driver.fed)
            task = asyncio.create_task(self._store_and_end(job, fed), name=f"store {job.req.rid[:12]}")
            self.finishing.add(task)
            task.add_done_callback(self._stored)
        else:
            await self._end(job)
        ttft = round(reply.stats.ttft_ms, 2) if reply is not None and reply.stats.token_ids else None
        self.figures.finished(job.req.tier, ttft, reply.stats.token_times if reply is not None else [])
        if error is not None:
            job.client.post(m.Error(message=error, id=job.rid))
            return
        if job.pool is not None or reply is None:
            assert job.pool is not None
            job.client.post(m.Embedded(id=job.rid, vector=job.pool.vector().tolist(),
                                       prompt_tokens=len(job.prompt), tier=job.req.tier))
            return
        st, finish = reply.stats, reply.finish or "length"  # (the scheduler's context limit: "length")
        job.client.post(m.Done(id=job.rid, token_ids=job.tokens, tier=job.req.tier, finish=finish,
                               ttft_ms=ttft, preemptions=job.req.preemptions,
                               decode_tok_s=round(st.decode_tok_s, 2), text=job.tail,
                               prompt_tokens=len(job.prompt), tool_call=st.tool_call))

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

    def stats(self) -> dict[str, Any]:
        recoveries = len(getattr(self.backend, "recoveries", ()))  # (a failover backend's)
        return self.figures.to_json(self.sched, {u.tier for u in self.users.values()}, recoveries)


def paced(pacer: Pacer, work: list[Job], ms: float) -> None:
    """The pacer learns from a step whose decode steps speculated or could have."""
    drafting = [j for j in work if j.driver.lookup is not None and j.call is not None]
    if drafting:
        pacer.timed(max(len(j.call.drafts.tokens) for j in drafting if j.call is not None), ms)


def this_step(d: Decision, jobs: dict[str, Job], cfg: GatewayConfig) -> list[Request]:
    """The requests that run this step: every decoding one, and prefill chunks up to
    `prefill_step_tokens` (at least one chunk), the shortest remaining prefill first, a
    prefill left out for steps gaining a chunk's worth each step. So a long prompt, or a
    long conversation recomputed after a preemption, costs others' decode steps at most
    one budget, and a short prompt is not queued behind it."""
    chunk = cfg.prefill_chunk_tokens
    decoding, prefilling = [], []
    for r in (*d.admit, *d.resume, *d.decode):
        (prefilling if jobs[r.rid].driver.pending else decoding).append(r)
    prefilling.sort(key=lambda r: len(jobs[r.rid].driver.pending) - chunk * jobs[r.rid].prefill_waits)
    budget = cfg.prefill_step_tokens
    for k, r in enumerate(prefilling):
        job = jobs[r.rid]
        size = min(chunk, len(job.driver.pending))
        if k == 0 or size <= budget:
            budget -= size
            job.prefill_waits = 0
            decoding.append(r)
        else:
            job.prefill_waits += 1
    return decoding


def advance(sched: Scheduler, r: Request, made: int, done: bool, keep_kv: bool) -> None:
    """Count `made` tokens of r's step in the scheduler (their KV), the last ending it when
    `done` (a finished request's KV kept counted until it is stored: keep_kv)."""
    for i in range(made):
        sched.advance(r, done=done and i == made - 1, keep_kv=keep_kv)
        if r.queue == "finished":
            return


async def recover(sched: Scheduler, backend: Backend, figures: Figures, cfg: GatewayConfig) -> None:
    """A node was lost: running requests go back to the queue (their tokens kept), and the
    plan is deployed again until that works."""
    back = sched.lost_kv()
    if back:
        log.warning("a node was lost; %d running requests wait to resume", len(back))
    try:
        await backend.reopen()
    except EdgeliteError as exc:
        figures.reconnect_failures += 1
        log.warning("deploying the plan again failed (%s); retrying in %g s", exc,
                    cfg.reconnect_interval_s)
        await asyncio.sleep(cfg.reconnect_interval_s)
        return
    figures.reconnects += 1
    log.info("the plan is deployed again; %d requests resume", len(back))


async def prompt_of(tok: Tokenizer, ask: Ask) -> list[int]:
    """tokens_of off the event loop (tokenizing a long prompt takes a while, and the loop
    also serves every other request and the nodes' heartbeats); a template that refuses the
    messages is the request's fault."""
    try:
        return await asyncio.to_thread(tokens_of, tok, ask)
    except EdgeliteError as exc:
        raise AskError(str(exc), "messages") from None


def tokens_of(tok: Tokenizer, ask: Ask) -> list[int]:
    """The request's prompt as token ids (chat messages through the model's template)."""
    if ask.messages is not None:
        return tok.chat_prompt(ask.messages, ask.tools or "", ask.tool_choice or "auto")
    return tok.text_prompt(ask.text or "")
