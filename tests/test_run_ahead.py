"""A gateway step of decodes alone lets each reply go on without waiting for the others
(GatewayConfig.run_ahead_tokens): the same replies in fewer scheduler steps, and a request
that arrives meanwhile is still admitted after the token in flight (the tiny Llama on the local
engine, behind the native door, real sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from test_doors import _doors

from edgelite.config import GatewayConfig, SchedulerConfig
from edgelite.manifest import load
from edgelite.net import messages as m
from edgelite.serve.client import GatewayClient
from edgelite.serve.scheduler import Scheduler

pytestmark = pytest.mark.e2e

PROMPTS = ["hello there", "tell me a story", "what is a phone"]


class Replies:
    """Several requests on one native connection: one reader routes each message to its
    request; each piece's arrival time is kept."""

    def __init__(self, client: GatewayClient) -> None:
        self.client = client
        self.times: dict[int, list[float]] = {}
        self.done: dict[int, asyncio.Future[list[int]]] = {}
        self.watch: tuple[int, int, asyncio.Event] | None = None  # (rid, pieces, set when reached)

    async def read(self) -> None:
        while True:
            msg = await self.client.conn.recv()
            rid = getattr(msg, "id", None)
            if isinstance(msg, m.TokenPiece):
                self.times[msg.id].append(time.monotonic())
                if self.watch and self.watch[0] == rid and len(self.times[rid]) >= self.watch[1]:
                    self.watch[2].set()
            elif isinstance(msg, m.Error) and rid in self.done:
                self.done[rid].set_exception(AssertionError(msg.message))
            elif isinstance(msg, m.Done):
                self.done[msg.id].set_result(msg.token_ids)

    async def ask(self, rid: int, prompt: str, tokens: int) -> list[int]:
        self.times[rid], self.done[rid] = [], asyncio.get_running_loop().create_future()
        await self.client.conn.send(m.GenerateRequest(id=rid, prompt=prompt, max_tokens=tokens,
                                                      temperature=0.0))
        return await asyncio.wait_for(self.done[rid], 60)


def test_replies_run_ahead_the_same_and_a_newcomer_waits_for_one_token(exported) -> None:
    manifest = load(exported["llama"])

    async def run(ahead: int) -> tuple[list[list[int]], int, int]:
        cfg = GatewayConfig(port=0, run_ahead_tokens=ahead)
        sched = Scheduler(SchedulerConfig(context_limit=manifest.max_positions, kv_tokens=4096))
        async with _doors(manifest, cfg, sched) as (gw, _, _, client):
            r = Replies(client)
            reader = asyncio.get_running_loop().create_task(r.read())
            try:
                ids = await asyncio.gather(*(r.ask(i, p, 24) for i, p in enumerate(PROMPTS)))
                steps = len(gw.figures.step_sizes)
                # newcomers while two long replies run ahead (arriving at several points of a
                # step): the long replies' tokens between a newcomer's arrival in the
                # scheduler and its admission (only the one in flight)
                long = asyncio.gather(*(r.ask(10 + i, p, 120) for i, p in enumerate(PROMPTS[:2])))
                between = 0
                for k, pieces in enumerate((12, 15, 26, 31)):
                    reached = asyncio.Event()
                    r.watch = (10, pieces, reached)
                    await asyncio.wait_for(reached.wait(), 60)
                    running = [j.driver.reply.stats.token_times for j in gw.jobs.values()]
                    await r.ask(20 + k, PROMPTS[2], 2)
                    new = next(x for x in reversed(sched.finished) if x.max_output == 2)
                    assert len(running) == 2 and new.admitted_at is not None
                    between = max(between, *(sum(1 for t in times if new.arrival < t < new.admitted_at)
                                             for times in running))
                await long
                return ids, steps, between
            finally:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader

    async def main() -> None:
        alone_ids, alone_steps, alone_between = await run(0)
        ids, steps, between = await run(7)
        assert ids == alone_ids  # the same replies
        assert all(len(x) > 8 for x in ids), ids  # (long enough to run ahead)
        assert steps * 3 <= alone_steps, (steps, alone_steps)
        assert between <= 1 and alone_between <= 1, (between, alone_between)

    asyncio.run(main())
