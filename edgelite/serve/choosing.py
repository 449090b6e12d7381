"""Constrained token choices off the scheduling loop's path: a reply held to a JSON schema or
that may be a tool call weighs many candidate tokens for each one it takes (reply/jsonprefix.py,
up to GenerationConfig.constraint_token_s), in a worker thread. The loop does not wait for it:
the request sits out the steps until its token is chosen and delivered, while every other
request's steps go on (a costly schema used to hold each step, and so every other user's
tokens, for as long as its choice took).

Each choice is a task kept here until it ends (none is left running: `settle` waits for the
ones asked, `close` for all); a failure that is not the request's own (a bug) is raised to the
loop at its next `check`, as it would have been raised in the loop itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterable
from typing import Any


class Choosing:
    """The requests whose constrained token is being chosen now (by scheduler rid)."""

    def __init__(self, wake: asyncio.Event) -> None:
        self.wake = wake  # set when a choice ends (the loop may step that request again)
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.failed: BaseException | None = None

    def busy(self, rid: str) -> bool:
        return rid in self.tasks

    def start(self, rid: str, choice: Coroutine[Any, Any, None]) -> None:
        """Run `choice` (delivering the request's step) off the loop's path."""
        task = asyncio.get_running_loop().create_task(choice, name=f"choosing {rid[:12]}")
        self.tasks[rid] = task
        task.add_done_callback(lambda t: self._ended(rid, t))

    def _ended(self, rid: str, task: asyncio.Task[None]) -> None:
        if self.tasks.get(rid) is task:
            del self.tasks[rid]
        if not task.cancelled() and task.exception() is not None:
            self.failed = self.failed or task.exception()  # (kept for the loop, which raises it)
        self.wake.set()

    def check(self) -> None:
        """Raise a choice's failure that was not its request's own (a bug), once."""
        if self.failed is not None:
            exc, self.failed = self.failed, None
            raise exc

    async def settle(self, rids: Iterable[str] | None = None) -> None:
        """Wait until the choices of `rids` (None: all) have ended."""
        asked = None if rids is None else set(rids)
        waiting = [t for rid, t in list(self.tasks.items()) if asked is None or rid in asked]
        if waiting:
            await asyncio.wait(waiting)

    async def wait_any(self, timeout_s: float) -> None:
        """Until a choice ends, a request arrives (`wake`) or `timeout_s` pass."""
        self.wake.clear()
        woken = asyncio.get_running_loop().create_task(self.wake.wait())
        try:
            await asyncio.wait([woken, *self.tasks.values()], timeout=timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await woken

    async def close(self) -> None:
        running = list(self.tasks.values())
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)  # (the loop is ending: no more raised)
