"""`edgelite serve`: many users' requests through one model, ordered by the scheduler.

Requests come in through the front doors (`serve/native.py`, the wire protocol; `serve/http.py`,
the OpenAI API) as an `Ask` (`serve/ask.py`), which `submit` checks and queues; each request's
tokens come out of its own reply driver (`reply/driver.py`) and go to its door's `Sink` as plain
events (`serve/events.py`: Token pieces, ending with Finished or Failed), which each door puts
in its own format.

Each scheduler step becomes backend calls: admitted requests prefill their prompt, resumed ones
import the KV they were preempted with from the KV stores (`swap_preempted`: it was stored when
they were preempted) and compute what the stores lack, running ones decode one token; all of a
step's calls go through the pipeline at once. A prompt is prefilled `prefill_chunk_tokens` at a
time, one chunk per step, so a long prompt shares the pipeline with everyone else's decode steps
instead of stalling their streams.

A constrained reply's token choice (JSON, a schema, a tool call: many candidates weighed a
token) runs off the event loop, and its schema is bounded up front (`max_schema_values`).

A client that disconnects, or cancels one of its requests, has them cancelled (queued ones are
never prefilled). When a node is lost (e.g. it restarted), every running request keeps its
tokens and goes back to the queue; the gateway deploys the plan again (every
`reconnect_interval_s` until the nodes are back) and the requests resume where they were.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Coroutine
from typing import Any

import numpy as np

from edgelite.config import GatewayConfig, GenerationConfig
from edgelite.errors import EdgeliteError, QueueFull
from edgelite.ids import new_session_id
from edgelite.reply.backend import Backend, run, stored_kv_failed
from edgelite.reply.driver import ReplyDriver
from edgelite.reply.embed import Pool
from edgelite.reply.loop import ReplyLoop, constrained, fitted
from edgelite.reply.speculate import Lookup, Pacer
from edgelite.reply.tokenizer import StreamDecoder, Tokenizer
from edgelite.serve.ask import Ask, AskError, check, generation
from edgelite.serve.choosing import Choosing
from edgelite.serve.events import Embedded, Failed, Finished
from edgelite.serve.figures import Figures
from edgelite.serve.job import Job, Sink
from edgelite.serve.kvmoves import KvMoves
from edgelite.serve.prefillpace import PrefillPace
from edgelite.serve.scheduler import Decision, Request, Scheduler
from edgelite.serve.users import User

log = logging.getLogger(__name__)


class Gateway:
    """Requests in (`submit`, `cancel`), the scheduling loop (`run`): each step's calls through
    the backend at once, each result to its request's driver, its events to the client."""

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
        self.kv = KvMoves(backend, scheduler, self.figures, self.cfg)  # KV while not running
        self.pacer = Pacer()  # how many drafts speculating requests offer (learns as they run)
        self.tokenizing: Counter[str] = Counter()  # user -> its requests being tokenized
        self.choosing = Choosing(self.wake)  # constrained tokens being chosen (serve/choosing.py)
        self.pace = PrefillPace(self.cfg.prefill_chunk_tokens, self.cfg.prefill_min_chunk_tokens,
                                self.cfg.prefill_slowdown)  # prompt tokens a step (serve/prefillpace.py)
        self.down: str | None = None  # why the last deploy after a node loss failed (None: it did not)

    async def run(self) -> None:
        """The scheduling loop, until cancelled."""
        sys.setswitchinterval(self.cfg.switch_interval_s)
        try:
            await self._loop()
        finally:
            await self.choosing.close()
            await self.kv.close()

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
        self.jobs[req.rid] = self._job(req, sink, rid, ask.embedding, gen, prompt)
        self.wake.set()

    def _job(self, req: Request, sink: Sink, rid: int, embedding: bool, gen: GenerationConfig,
             prompt: list[int]) -> Job:
        if embedding:
            pool = Pool(self.backend.manifest.hidden_size)
            return Job(req, sink, rid, ReplyDriver(None, prompt, pool=pool), pool=pool)
        reply = ReplyLoop(gen, self.eos, StreamDecoder(self.tok), started=req.arrival, prompt=prompt)
        spec = gen.speculate == "lookup" and not constrained(gen)
        return Job(req, sink, rid, ReplyDriver(reply, prompt, *((Lookup(), self.pacer.fork()) if spec
                                                              else (None, None))))

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
            self.choosing.check()
            await self._cancel_gone()
            if not self.backend.healthy:
                await self.choosing.settle()
                self.down = await recover(self.sched, self.backend, self.figures, self.cfg)
                if self.down is not None:  # (no plan without the node: nobody waits for one)
                    self._fail_all(f"the cluster cannot serve now: {self.down}")
                    await asyncio.sleep(self.cfg.reconnect_interval_s)
                continue
            rejoin = getattr(self.backend, "rejoin", None)  # (a failover backend's)
            if rejoin is not None and await rejoin() is not None:  # nodes left out are back
                self.figures.rejoins += 1
            d = self.sched.decide(time.monotonic())
            for r in d.preempt:
                if r.queue == "waiting":  # put back for fair shares (not a preemption)
                    log.info("%s (user %s) gives its slot back to another user after %d tokens",
                             r.rid[:12], r.user, r.generated)
                    continue
                self.figures.tier(r.tier).preemptions += 1
                log.info("preempted %s (tier %d, user %s) after %d tokens", r.rid[:12], r.tier,
                         r.user, r.generated)
            await self.choosing.settle(r.rid for r in d.preempt)  # (a token being chosen lands first)
            ends = [self.kv.give_up(self.jobs[r.rid]) for r in d.preempt]  # alongside this step's work
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
                await self.kv.settled()  # a new prompt may extend one being stored now
                # new requests look for a stored prefix alongside this step (the others'
                # tokens do not wait for the lookup); they join the steps from the next one
                looking = [self.kv.reuse(job) for job in new]
            await asyncio.gather(*(self.kv.take_back(job) for job in back))
            skip = {job.req.rid for job in new} if looking else set()
            decoding = any(not self.jobs[r.rid].driver.pending for r in (*d.admit, *d.resume, *d.decode))
            chunk = self.pace.size(decoding)
            work = [self.jobs[r.rid] for r in this_step(d, self.jobs, self.cfg, chunk)
                    if r.rid not in skip and not self.choosing.busy(r.rid)]
            prefilling = [job for job in work if job.driver.pending]
            calls: list[Coroutine[Any, Any, Any] | Awaitable[np.ndarray]] = []
            if work:
                self.figures.step_sizes.append(len(work))
            ahead = not (prefilling or ends or looking) and all(map(may_chain, work))
            for job in work:
                job.call = job.driver.next_call(chunk)
                calls.append(self._chain(job) if ahead else run(self.backend, job.session, job.call))
            if not (work or ends or looking):  # (every running request's token is being chosen)
                await self.choosing.wait_any(self.cfg.idle_poll_s)
                continue
            t0 = time.perf_counter()
            results = await asyncio.gather(*ends, *looking, *calls, return_exceptions=True)
            ms = (time.perf_counter() - t0) * 1e3
            paced(self.pacer, work, ms)
            # (a step of chains: each returned the tokens it made, the most are the step's rounds)
            rounds = max((x for x in results if isinstance(x, int)), default=1) if ahead else 1
            if not (ends or looking):  # (a step of its own work alone teaches the pace)
                self.pace.timed(bool(prefilling), len(prefilling) < len(work), ms / rounds)
            for x in results[len(ends):len(ends) + len(looking)]:
                if isinstance(x, BaseException):
                    raise x  # (KvMoves.reuse handles what a lookup may meet: this is a bug)
            results = results[len(ends) + len(looking):]
            lost = not self.backend.healthy
            for job, result in zip(work, results, strict=True):
                if isinstance(result, int):
                    continue  # (a chain: delivered as it went)
                if lost and isinstance(result, BaseException):
                    continue  # the request goes back to the queue (_recover)
                if job.driver.restored and stored_kv_failed(result):
                    await self.kv.recompute(job, result)
                    continue
                reply = job.driver.reply
                if reply is not None and constrained(reply.cfg) and not isinstance(result, BaseException):
                    self.choosing.start(job.req.rid, self._deliver(job, result))  # (the others go on)
                else:
                    await self._deliver(job, result)

    async def _chain(self, job: Job) -> int:
        """Run the job's decode call and deliver its token, then while `_may_go_on` its next
        ones, up to `run_ahead_tokens` more: the tokens it made this step. A lost node's
        failure is left for the recovery (the request goes back to the queue), as in the loop."""
        made = 0
        while True:
            assert job.call is not None
            (result,) = await asyncio.gather(run(self.backend, job.session, job.call),
                                             return_exceptions=True)  # (as the loop's gather)
            if isinstance(result, BaseException) and not self.backend.healthy:
                return max(made, 1)
            await self._deliver(job, result)
            made += 1
            if made > self.cfg.run_ahead_tokens or not self._may_go_on(job):
                return made
            job.call = job.driver.next_call(self.cfg.prefill_chunk_tokens)

    def _may_go_on(self, job: Job) -> bool:
        """A running reply may take its next token before the step's others: nothing waits to
        be admitted or resumed, the cluster is whole, and its next token's KV fits."""
        return (self.jobs.get(job.req.rid) is job and job.req.queue == "running"
                and not (job.driver.done or job.driver.pending or job.client.gone or job.cancelled)
                and self.backend.healthy and self.sched.quiet_for(job.req))

    async def _cancel_gone(self) -> None:
        """Cancel the requests of clients that went away or said stop: queued ones are never
        prefilled, running ones free their KV now."""
        ends = []
        for job in [j for j in self.jobs.values() if j.client.gone or j.cancelled]:
            log.info("cancelled %s of %s (%s), who left after %d tokens", job.req.rid[:12],
                     job.client.peer, job.req.queue, len(job.tokens))
            if job.req.queue == "running":
                ends.append(self.kv.end(job))
            self.sched.cancel(job.req)
            del self.jobs[job.req.rid]
            self.figures.cancelled += 1
        await asyncio.gather(*ends)

    def _fail_all(self, error: str) -> None:
        """Every request ends with `error` (the cluster cannot run them; their KV is gone)."""
        for job in list(self.jobs.values()):
            log.warning("request %s failed: %s", job.req.rid[:12], error)
            self.sched.cancel(job.req)
            del self.jobs[job.req.rid]
            job.client.post(Failed(job.rid, error))

    async def _deliver(self, job: Job, result: np.ndarray | BaseException) -> None:
        r = job.req
        if job.client.gone or job.cancelled:
            return  # cancelled at the top of the next round
        if isinstance(result, BaseException):
            if not isinstance(result, EdgeliteError):
                raise result
            await self._fail(job, result)
            return
        assert job.call is not None
        before, reply = len(job.tokens), job.driver.reply
        try:
            if reply is not None and constrained(reply.cfg):  # (a JSON or tool choice weighs many
                # candidates a token: off the event loop, the doors keep answering meanwhile)
                out = await asyncio.to_thread(job.driver.took, job.call, result)
                if job.client.gone or job.cancelled:
                    return  # (it left while its token was chosen: cancelled at the next round)
            else:
                out = job.driver.took(job.call, result)
        except EdgeliteError as exc:  # (a reply that cannot go on: this request alone ends)
            await self._fail(job, exc)
            return
        if job.pool is not None:  # an embedding: its chunk's states, the last ending it
            if job.driver.done:
                self.sched.advance(r, done=True)
                await self._finish(job)
            return
        if not job.call.gives:
            return  # a prefill chunk before the last
        assert reply is not None
        for piece in out.pieces:
            if piece.token_id is not None:
                self.figures.token(reply.stats.token_times[-1])
            job.emit(piece)
        made = len(job.tokens) - before + (reply.finish == "eos")  # (EOS ends it: one more)
        advance(self.sched, r, made, reply.done, self.cfg.reuse_prefixes)
        if r.queue == "finished":
            await self._finish(job)
        elif out.rollback is not None:  # the stages give back the refused drafts' positions
            await self.backend.rollback(job.session, out.rollback)

    async def _fail(self, job: Job, exc: EdgeliteError) -> None:
        """A request that cannot go on ends alone, its client told why."""
        log.warning("request %s failed: %s", job.req.rid[:12], exc)
        self.sched.advance(job.req, done=True)
        await self._finish(job, error=str(exc))

    async def _finish(self, job: Job, error: str | None = None) -> None:
        del self.jobs[job.req.rid]
        reply = job.driver.reply
        if error is None and self.cfg.reuse_prefixes and job.pool is None:  # its KV, for reuse
            self.kv.keep(job)
        else:
            await self.kv.end(job)
        ttft = round(reply.stats.ttft_ms, 2) if reply is not None and reply.stats.token_ids else None
        req = job.req
        wait = None if req.admitted_at is None else round((req.admitted_at - req.arrival) * 1e3, 2)
        self.figures.finished(req.tier, ttft, reply.stats.token_times if reply is not None else [], wait)
        if error is not None:
            job.client.post(Failed(job.rid, error))
            return
        if job.pool is not None or reply is None:
            assert job.pool is not None
            job.client.post(Embedded(job.rid, job.pool.vector().tolist(), len(job.prompt),
                                     job.req.tier))
            return
        st, finish = reply.stats, reply.finish or "length"  # (the scheduler's context limit: "length")
        job.client.post(Finished(job.rid, list(job.tokens), finish, job.req.tier,
                                 job.req.preemptions, len(job.prompt), ttft,
                                 round(st.decode_tok_s, 2), job.tail, st.tool_call))

    def stats(self) -> dict[str, Any]:
        recoveries = len(getattr(self.backend, "recoveries", ()))  # (a failover backend's)
        return self.figures.to_json(self.sched, {u.tier for u in self.users.values()}, recoveries)


def paced(pacer: Pacer, work: list[Job], ms: float) -> None:
    """The pacer learns from a step whose decode steps speculated or could have."""
    drafting = [j for j in work if j.driver.lookup is not None and j.call is not None]
    if drafting:
        pacer.timed(max(len(j.call.drafts.tokens) for j in drafting if j.call is not None), ms)


def may_chain(job: Job) -> bool:
    """A request whose decode steps may run ahead of a step's others (Gateway._chain): not an
    embedding, not constrained (chosen off the loop), not speculating (the pacer times its
    steps), not on KV just restored (a failed import is recomputed by the loop)."""
    reply = job.driver.reply
    return (job.pool is None and reply is not None and not constrained(reply.cfg)
            and job.driver.lookup is None and not job.driver.restored)


def this_step(d: Decision, jobs: dict[str, Job], cfg: GatewayConfig, chunk: int) -> list[Request]:
    """The requests that run this step: every decoding one, and prefill chunks (of `chunk`
    tokens: serve/prefillpace.py) up to `prefill_step_tokens` (at least one chunk), the
    shortest remaining prefill first, a prefill left out for steps gaining a chunk's worth each
    step. So a long prompt, or a long conversation recomputed after a preemption, costs others'
    decode steps at most one budget, and a short prompt is not queued behind it."""
    decoding, prefilling = [], []
    for r in (*d.admit, *d.resume, *d.decode):
        (prefilling if jobs[r.rid].driver.pending else decoding).append(r)
    prefilling.sort(key=lambda r: len(jobs[r.rid].driver.pending) - chunk * jobs[r.rid].prefill_waits)
    budget = max(chunk, cfg.prefill_step_tokens * chunk // cfg.prefill_chunk_tokens)  # (paced too)
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


async def recover(sched: Scheduler, backend: Backend, figures: Figures, cfg: GatewayConfig) -> str | None:
    """A node was lost: running requests go back to the queue (their tokens kept), and the
    plan is deployed again: None when that worked, else why not (the caller tries again in
    `reconnect_interval_s`; a node that comes back is asked afresh each time)."""
    back = sched.lost_kv()
    if back:
        log.warning("a node was lost; %d running requests wait to resume", len(back))
    try:
        await backend.reopen()
    except EdgeliteError as exc:
        figures.reconnect_failures += 1
        log.warning("deploying the plan again failed (%s); retrying in %g s", exc,
                    cfg.reconnect_interval_s)
        return str(exc)
    figures.reconnects += 1
    log.info("the plan is deployed again; %d requests resume", len(back))
    return None


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
