"""A byte budget shared by a process's connections: frames being read and held count against
it, and a frame that does not fit waits (unread, in the socket's buffers: its sender waits
too) until others are done. One frame always fits when nothing else is held, so a frame up to
the wire limit is never refused by it. Event-loop only (no locks)."""

from __future__ import annotations

import asyncio


class ByteBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.waited = 0  # frames that had to wait for room
        self._freed = asyncio.Event()

    async def take(self, n: int) -> None:
        """Hold n bytes, once they fit."""
        if self.held and self.held + n > self.limit:
            self.waited += 1
            while self.held and self.held + n > self.limit:
                self._freed.clear()
                await self._freed.wait()
        self.held += n

    def give(self, n: int) -> None:
        self.held -= n
        self._freed.set()
