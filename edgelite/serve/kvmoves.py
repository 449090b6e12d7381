"""Where a request's KV goes while it does not run (`KvMoves`): a preempted request's KV is
stored (`swap_preempted`) and freed, and imported again when it resumes; a new request
imports the KV of the longest stored prefix of its prompt (`reuse_prefixes`); a finished
request's KV is stored for later prompts beside the steps (`finishing`: tasks, not in the way
of the other requests' tokens), then freed. What the stores lack is computed (the figures
count both)."""

from __future__ import annotations

import asyncio
import logging

from edgelite.config import GatewayConfig
from edgelite.errors import EdgeliteError
from edgelite.reply.backend import Backend
from edgelite.serve.figures import Figures
from edgelite.serve.job import Job
from edgelite.serve.scheduler import Scheduler

log = logging.getLogger(__name__)


class KvMoves:
    def __init__(self, backend: Backend, sched: Scheduler, figures: Figures, cfg: GatewayConfig) -> None:
        self.backend, self.sched, self.figures, self.cfg = backend, sched, figures, cfg
        self.finishing: set[asyncio.Task[None]] = set()  # finished requests' KV being stored

    async def close(self) -> None:
        """Stop storing what is being stored."""
        for t in self.finishing:
            t.cancel()
        await asyncio.gather(*self.finishing, return_exceptions=True)

    async def settled(self) -> None:
        """Wait (at most `store_wait_s`) for what is being stored: a new prompt may extend it."""
        if self.finishing:
            await asyncio.wait(set(self.finishing), timeout=self.cfg.store_wait_s)

    def keep(self, job: Job) -> None:
        """A finished request's KV into the stores, beside the steps; then freed."""
        task = asyncio.create_task(self._store_and_end(job, list(job.driver.fed)),
                                   name=f"store {job.req.rid[:12]}")
        self.finishing.add(task)
        task.add_done_callback(self._stored)

    async def give_up(self, job: Job) -> None:
        """A preempted request gives its KV up: stored first (`swap_preempted`), then freed."""
        if self.cfg.swap_preempted and job.pool is None:
            held = list(job.driver.fed)
            try:
                if await self.backend.save(job.session, held, behind=True):
                    job.swapped = len(held)
            except EdgeliteError as exc:
                log.info("%s: its KV was not stored (%s); it will be recomputed", job.req.rid[:12], exc)
        await self.end(job)

    async def take_back(self, job: Job) -> None:
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

    async def reuse(self, job: Job) -> None:
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

    async def recompute(self, job: Job, exc: BaseException) -> None:
        """A node could not read the KV it had found for a resumed request, or for a new one's
        prompt, after all (its first step failed): the request computes it instead."""
        log.info("%s: its stored KV was not usable after all (%s); it is recomputed",
                 job.req.rid[:12], exc)
        await self.end(job)
        n = job.driver.unusable()
        if job.reused:
            self.figures.reused_tokens -= n
        else:
            self.figures.swapped_tokens -= n
            self.figures.recomputed_tokens += n
        job.reused = False

    async def end(self, job: Job) -> None:
        """Free a request's KV on the nodes (best effort: a lost node has freed it anyway)."""
        try:
            await self.backend.end(job.session)
        except EdgeliteError as exc:
            log.debug("ending %s: %s", job.req.rid[:12], exc)

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
                await self.end(job)
            finally:
                self.sched.release(job.req)

    def _stored(self, task: asyncio.Task[None]) -> None:
        self.finishing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("storing a finished request's KV failed: %r", task.exception())
