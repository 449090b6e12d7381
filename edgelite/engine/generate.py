"""Generation: a model backend (local chain or remote cluster) driven by the reply loop.

A backend maps (session, new token ids) -> logits of the last position, keeping the session's
KV cache wherever its layers live. The engine owns no UI.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

import numpy as np

from edgelite.config import GenerationConfig, RuntimeConfig
from edgelite.engine.kvstore import restore_into
from edgelite.engine.reply import Piece, ReplyLoop, Stats
from edgelite.engine.runtime import ClientPart, LocalChain
from edgelite.engine.tokenizer import StreamDecoder
from edgelite.errors import EdgeliteError, NodeError, NodeUnavailable
from edgelite.manifest import Manifest

log = logging.getLogger(__name__)
T = TypeVar("T")
OnThread = Callable[[Callable[[], T]], Awaitable[T]]  # runs a function on a part's own thread


class Backend(Protocol):
    manifest: Manifest

    async def step(self, session: str, ids: np.ndarray) -> np.ndarray:
        """ids (1, seq) appended to the session -> logits (vocab,) of the last position."""
        ...

    async def end(self, session: str) -> None:
        """Free the session's KV everywhere."""
        ...

    async def restore(self, session: str, tokens: list[int]) -> int:
        """Start a new session from the KV stores: every part imports the longest prefix of
        `tokens` they all hold. Returns its length (0: nothing stored, compute from the start)."""
        ...

    async def save(self, session: str, tokens: list[int], behind: bool = False) -> int:
        """Store the session's KV for `tokens` (the ids it consumed, in order) in every part's
        KV store (best effort). Returns once the entries are on disk, or, `behind`, once the KV
        is copied (the session may end; the files are written behind and later lookups wait
        for them: what a server does, whose other requests should not wait for the disk; a
        process killed meanwhile loses them). Returns the bytes stored."""
        ...

    async def close(self) -> None:
        """Release threads and connections."""
        ...

    @property
    def healthy(self) -> bool:
        """False once a part of it is lost (a node gone): `reopen` before the next step."""
        ...

    async def reopen(self) -> None:
        """Set it up again after a loss (every session is gone); raises while it cannot."""
        ...


class LocalBackend:
    """All layers in this process; ONNX runs in one long-lived worker thread, off the event
    loop (a pool's other threads would start cold)."""

    def __init__(self, manifest: Manifest, cfg: RuntimeConfig | None = None) -> None:
        self.manifest = manifest
        self.chain = LocalChain(manifest, cfg)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="local-onnx")

    async def step(self, session: str, ids: np.ndarray) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, self.chain.forward, session, ids)

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


def stored_kv_failed(exc: BaseException) -> bool:
    """Whether the first step after a restore failed because a stage could not use the KV it
    had found (its entry failed the checks when read: a node refused the step) rather than
    because a node was lost: the prompt is then computed instead."""
    return isinstance(exc, NodeError) and not isinstance(exc, NodeUnavailable)


async def generate(backend: Backend, prompt: list[int], cfg: GenerationConfig,
                   stats: Stats | None = None, session: str | None = None, reuse: bool = True,
                   decoder: StreamDecoder | None = None) -> AsyncIterator[Piece]:
    """Yield the reply's pieces (engine/reply.py: its rules end it); fills `stats` as it goes.
    `decoder` gives the pieces text (None: ids only). With `reuse`, the prompt's longest stored
    prefix is imported from the KV stores instead of computed, and the conversation's KV is
    stored when the reply ends."""
    if not prompt:
        raise EdgeliteError("the prompt is empty (no tokens to start from)")
    reply = ReplyLoop(cfg, backend.manifest.eos_token_ids, decoder, stats=stats)
    stats = reply.stats
    stats.prompt_tokens = len(prompt)
    session = session or secrets.token_hex(16)
    fed: list[int] = []  # the ids the session holds KV for
    ok = False
    try:
        if reuse and len(prompt) > 1:
            stats.reused_tokens = await backend.restore(session, prompt[:-1])
            fed = prompt[:stats.reused_tokens]
        ids = prompt[len(fed):]
        while not reply.done:
            try:
                logits = await backend.step(session, np.array([ids], np.int64))
            except NodeError as exc:
                if stats.token_ids or not fed or not stored_kv_failed(exc):
                    raise
                # a stage could not use its stored KV after all (an entry failed its checks
                # when read): the prompt is computed instead
                log.warning("the stored KV of the prompt's first %d tokens was not usable (%s); "
                            "computing them", len(fed), exc)
                await backend.end(session)
                stats.reused_tokens, fed, ids = 0, [], prompt
                logits = await backend.step(session, np.array([ids], np.int64))
            fed += ids
            piece = reply.next(logits)
            if piece is not None:
                yield piece
            if piece is not None and piece.token_id is not None:
                ids = [piece.token_id]
        ok = True
    except GeneratorExit:  # the caller stopped reading (Ctrl-C): the KV is sound
        ok = True
        raise
    finally:
        if reuse and ok and fed:
            await backend.save(session, fed)
        await backend.end(session)
