"""The local backend: every layer in this process (engine/runtime.py's LocalChain) behind the
reply side's Backend protocol (reply/backend.py), and the client part's share of a cluster's
KV restore and save (client/backend.py uses those too)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from edgelite.config import RuntimeConfig
from edgelite.engine.kvstore import restore_into
from edgelite.engine.runtime import ClientPart, LocalChain
from edgelite.errors import EdgeliteError
from edgelite.manifest import Manifest

log = logging.getLogger(__name__)
T = TypeVar("T")
OnThread = Callable[[Callable[[], T]], Awaitable[T]]  # runs a function on a part's own thread


class LocalBackend:
    """All layers in this process; ONNX runs in one long-lived worker thread, off the event
    loop (a pool's other threads would start cold)."""

    def __init__(self, manifest: Manifest, cfg: RuntimeConfig | None = None) -> None:
        self.manifest = manifest
        self.chain = LocalChain(manifest, cfg)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="local-onnx")

    async def forward(self, session: str, ids: np.ndarray) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, self.chain.forward, session, ids)

    async def verify(self, session: str, ids: np.ndarray) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, self.chain.verify, session, ids)

    async def hidden(self, session: str, ids: np.ndarray) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, self.chain.hidden, session, ids)

    async def rollback(self, session: str, n: int) -> None:
        await asyncio.get_running_loop().run_in_executor(self.pool, self.chain.rollback, session, n)

    async def end(self, session: str) -> None:
        await asyncio.get_running_loop().run_in_executor(self.pool, self.chain.end, session)

    def _on_thread(self, fn: Callable[[], T]) -> Awaitable[T]:
        return asyncio.get_running_loop().run_in_executor(self.pool, fn)

    async def restore(self, session: str, tokens: list[int]) -> int:
        return await restore_part(self.chain.part, session, tokens, self._on_thread)

    async def save(self, session: str, tokens: list[int], behind: bool = False) -> int:
        return await save_part(self.chain.part, session, tokens, self._on_thread, behind)

    async def close(self) -> None:
        self.pool.shutdown(wait=True)

    @property
    def step_compute_ms(self) -> float | None:
        return None  # (all of a step is compute here)

    @property
    def context(self) -> int:
        return self.chain.layers.pool.max_length

    @property
    def healthy(self) -> bool:
        return True  # nothing here can be lost

    async def reopen(self) -> None:
        """Nothing to set up again."""


async def restore_part(part: ClientPart, session: str, tokens: list[int], on_thread: OnThread,
                       exact: bool = False) -> int:
    """The client part's share of `Backend.restore`: its layers' KV of the longest stored
    prefix of `tokens` (of all of them when `exact`, else nothing), read and checked off its
    thread straight into a slot reserved on it, which becomes the session's only when the
    entry passed every check. Returns the length imported."""
    if part.store is None or part.prefix is None:
        return 0
    store, layers = part.store, part.prefix
    slot = await on_thread(lambda: part.reserve(session))
    return await restore_into(store, layers.layout, np.array(tokens, np.int32), layers.pool.view(slot),
                              exact, lambda n: on_thread(lambda: part.attach(session, slot, n)),
                              lambda: on_thread(lambda: part.abandon(session, slot)))


async def save_part(part: ClientPart, session: str, tokens: list[int], on_thread: OnThread,
                    behind: bool = False) -> int:
    """The client part's share of `Backend.save`: a copy of its KV taken on its thread, written
    off it (`behind`: after returning, KVStore.put_later)."""
    if part.store is None or part.prefix is None or len(tokens) < part.store.block:
        return 0
    store, layout = part.store, part.prefix.layout
    try:
        kv = await on_thread(lambda: part.export_kv(session, len(tokens)))
        put = store.put_later if behind else store.put
        return await asyncio.to_thread(put, layout, np.array(tokens, np.int32), kv)
    except (EdgeliteError, OSError) as exc:
        log.warning("the session's KV was not stored: %s", exc)
        return 0
