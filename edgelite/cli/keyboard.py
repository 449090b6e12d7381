"""Lines typed at a prompt, and Ctrl-C, for the interactive chats.

Ctrl-C while a reply is written stops that reply (the chat goes back to the prompt); Ctrl-C at the
prompt ends the chat at once. A line is read from the stdin descriptor in a thread that waits with
`select` and looks every `POLL_S` whether the chat ended, so no thread is left blocked in a read
at exit (asyncio's executor would wait for it; a daemon thread inside Python's buffered stdin
aborts the interpreter's shutdown). The terminal's own line editing applies.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
POLL_S = 0.1  # how often a waiting reader looks whether the chat ended


class Keyboard:
    """Use as `async with Keyboard(show) as kb`: `await kb.line(prompt)` shows the prompt (with
    `show`) and is the next line typed, or None (end of input or Ctrl-C); `await
    kb.interruptible(coro)` runs coro until Ctrl-C."""

    def __init__(self, show: Callable[[str], None], fd: int | None = None) -> None:
        self._show = show
        self._fd = sys.stdin.fileno() if fd is None else fd
        self._running: asyncio.Task[Any] | None = None
        self._quit: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def quit(self) -> bool:
        """Ctrl-C was pressed at the prompt."""
        return self._quit is not None and self._quit.is_set()

    async def __aenter__(self) -> Keyboard:
        self._loop = asyncio.get_running_loop()
        self._quit = asyncio.Event()
        try:
            self._loop.add_signal_handler(signal.SIGINT, self._on_interrupt)
        except (NotImplementedError, RuntimeError):  # no signal handlers here (Windows, a thread)
            self._loop = None
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._loop is not None:
            self._loop.remove_signal_handler(signal.SIGINT)

    def _on_interrupt(self) -> None:
        if self._running is not None and not self._running.done():
            self._running.cancel()
        else:
            assert self._quit is not None
            self._quit.set()

    async def line(self, prompt: str) -> str | None:
        """The next line typed; None at end of input or on Ctrl-C (the chat should end)."""
        assert self._quit is not None
        self._show(prompt)
        done = threading.Event()
        reading = asyncio.ensure_future(asyncio.to_thread(self._read_line, done))
        quit_wait = asyncio.ensure_future(self._quit.wait())
        try:
            await asyncio.wait((reading, quit_wait), return_when=asyncio.FIRST_COMPLETED)
        finally:
            quit_wait.cancel()
            done.set()  # a reader still waiting gives up within POLL_S
        if self._quit.is_set():
            await asyncio.gather(reading, return_exceptions=True)
            return None
        return reading.result()

    def _read_line(self, done: threading.Event) -> str | None:
        """Bytes from the descriptor up to a newline, read one at a time (so `select` sees what
        is left); None at end of input, on a read error, or once `done` is set."""
        line = bytearray()
        while not done.is_set():
            try:
                ready, _, _ = select.select([self._fd], [], [], POLL_S)
                if not ready:
                    continue
                byte = os.read(self._fd, 1)
            except (OSError, ValueError):  # stdin closed or not selectable
                return None
            if not byte:
                return line.decode(errors="replace") if line else None
            if byte == b"\n":
                return line.decode(errors="replace").rstrip("\r")
            line += byte
        return None

    async def interruptible(self, coro: Coroutine[Any, Any, T]) -> tuple[bool, T | None]:
        """Run coro; (True, its result), or (False, None) when Ctrl-C stopped it."""
        task = asyncio.ensure_future(coro)
        self._running = task
        try:
            return True, await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():  # we were cancelled, not the reply
                raise
            return False, None
        finally:
            self._running = None
