"""Generation: a model backend (local chain or remote cluster) driven by the reply loop.

A backend maps (session, new token ids) -> logits of the last position, keeping the session's
KV cache wherever its layers live. The engine owns no UI.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

import numpy as np

from edgelite.config import GenerationConfig, RuntimeConfig
from edgelite.engine.kvstore import restore_into
from edgelite.engine.reply import Piece, ReplyLoop, Stats, fitted
from edgelite.engine.runtime import ClientPart, LocalChain
from edgelite.engine.speculate import WIDTHS, Draft, Lookup, Speculation
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

    async def verify(self, session: str, ids: np.ndarray) -> np.ndarray:
        """ids (1, seq) appended to the session in one step (seq within one chunk) -> logits
        (seq, vocab) at every position: a speculative step's drafts checked at once."""
        ...

    async def hidden(self, session: str, ids: np.ndarray) -> np.ndarray:
        """ids (1, seq) appended to the session in one step (seq within one chunk) -> (seq,
        hidden_size) the final norm's output at every position (what embeddings pool)."""
        ...

    async def rollback(self, session: str, n: int) -> None:
        """The session keeps its first n positions (at most kv.MAX_ROLLBACK fewer than it
        holds): the positions of rejected drafts. No message of its own: the next step
        carries it to every stage."""
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
    def step_compute_ms(self) -> float | None:
        """The stages' compute in the last step, in ms (None: unknown, or all of the step)."""
        ...

    @property
    def context(self) -> int:
        """The most positions a session may hold (the model's context, or less)."""
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


def stored_kv_failed(exc: BaseException) -> bool:
    """Whether the first step after a restore failed because a stage could not use the KV it
    had found (its entry failed the checks when read: a node refused the step) rather than
    because a node was lost: the prompt is then computed instead."""
    return isinstance(exc, NodeError) and not isinstance(exc, NodeUnavailable)


async def generate(backend: Backend, prompt: list[int], cfg: GenerationConfig,
                   stats: Stats | None = None, session: str | None = None, reuse: bool = True,
                   decoder: StreamDecoder | None = None,
                   speculation: Speculation | None = None) -> AsyncIterator[Piece]:
    """Yield the reply's pieces (engine/reply.py: its rules end it); fills `stats` as it goes.
    `decoder` gives the pieces text (None: ids only). With `reuse`, the prompt's longest stored
    prefix is imported from the KV stores instead of computed, and the conversation's KV is
    stored when the reply ends. With `speculation`, decode steps verify drafts (see
    engine/speculate.py; the output is the same)."""
    if not prompt:
        raise EdgeliteError("the prompt is empty (no tokens to start from)")
    cfg = fitted(cfg, len(prompt), backend.context, backend.manifest, "the KV this engine holds")
    reply = ReplyLoop(cfg, backend.manifest.eos_token_ids, decoder, stats=stats, prompt=prompt)
    stats = reply.stats
    stats.prompt_tokens = len(prompt)
    session = session or secrets.token_hex(16)
    fed: list[int] = []  # the ids the session holds KV for
    ok = False
    try:
        if reuse and len(prompt) > 1:
            stats.reused_tokens = await backend.restore(session, prompt[:-1])
            fed = prompt[:stats.reused_tokens]
        draft = speculation.draft if speculation is not None else None
        if draft is None:
            logits = await _prefill(backend, session, prompt, fed, stats)
        else:  # the draft computes the prompt meanwhile
            try:
                async with asyncio.TaskGroup() as tg:
                    target = tg.create_task(_prefill(backend, session, prompt, fed, stats))
                    tg.create_task(draft.prepare(session, prompt))
            except ExceptionGroup as group:  # (the first failure, as a plain step raises it)
                raise group.exceptions[0] from None
            logits = target.result()
        fed = list(prompt)
        piece = reply.next(logits)
        if piece is not None:
            yield piece
        rounds = _Rounds(backend, session, prompt, reply, speculation)
        while not reply.done:
            for piece in await rounds.next(fed):
                yield piece
        ok = True
    except GeneratorExit:  # the caller stopped reading (Ctrl-C): the KV is sound
        ok = True
        raise
    finally:
        if reuse and ok and fed:
            await backend.save(session, fed)
        await backend.end(session)
        if speculation is not None and speculation.draft is not None:
            await speculation.draft.end(session)


async def _prefill(backend: Backend, session: str, prompt: list[int], fed: list[int],
                   stats: Stats) -> np.ndarray:
    """The prompt's step(s) after the `fed` tokens imported from the KV stores: the logits
    of its last position."""
    ids = prompt[len(fed):]
    try:
        return await backend.step(session, np.array([ids], np.int64))
    except NodeError as exc:
        if not fed or not stored_kv_failed(exc):
            raise
    # a stage could not use its stored KV after all (an entry failed its checks when read):
    # the prompt is computed instead
    log.warning("the stored KV of the prompt's first %d tokens was not usable; computing them",
                len(fed))
    await backend.end(session)
    stats.reused_tokens = 0
    return await backend.step(session, np.array([prompt], np.int64))


class _Rounds:
    """A reply's decode steps: a plain step per token, or (speculation) a verification of
    the drafts the pacer asks for, with the rejected positions given back."""

    def __init__(self, backend: Backend, session: str, prompt: list[int], reply: ReplyLoop,
                 spec: Speculation | None) -> None:
        self.backend, self.session, self.prompt, self.reply, self.spec = backend, session, prompt, reply, spec
        self.lookup = Lookup() if spec is not None and spec.draft is None else None
        self.pacer = spec.pacer.fork() if spec is not None else None

    async def next(self, fed: list[int]) -> list[Piece]:
        """One round; `fed` (the ids whose KV the session holds) grows by what it fed."""
        reply, stats = self.reply, self.reply.stats
        last = stats.token_ids[-1]
        found, draft = await self._draft()
        t0 = time.perf_counter()
        if not draft.tokens:
            logits = await self.backend.step(self.session, np.array([[last]], np.int64))
            fed.append(last)
            piece = reply.next(logits)
            if self.pacer is not None:
                self.pacer.observe(0, 0, (time.perf_counter() - t0) * 1e3, self.backend.step_compute_ms)
                if found.tokens:  # (what the unused lookup would have said)
                    self.pacer.shadow(found.tokens[0], int(np.argmax(logits)), found.kind)
            return [piece] if piece is not None else []
        ids = [last, *draft.tokens]
        logits = await self.backend.verify(self.session, np.array([ids], np.int64))
        ms = (time.perf_counter() - t0) * 1e3
        pieces, accepted = reply.verify(logits, draft.tokens, draft.q)
        fed += ids[:1 + accepted]
        assert self.pacer is not None
        self.pacer.observe(len(draft.tokens), accepted, ms, kind=draft.kind)
        if accepted < len(draft.tokens) and not reply.done:
            await self.backend.rollback(self.session, len(fed))
        return pieces

    async def _draft(self) -> tuple[Draft, Draft]:
        """(what the lookup found, the drafts to verify now): a lookup is asked first, then
        the pacer says how many of its tokens pay, given how good such a match has been; a
        draft model is asked for as many as pay."""
        spec, pacer, reply, stats = self.spec, self.pacer, self.reply, self.reply.stats
        if spec is None or pacer is None:
            return Draft([]), Draft([])
        fixed = reply.cfg.draft_tokens
        left = min(reply.cfg.max_tokens - len(stats.token_ids) - 1, WIDTHS[-1] - 1)  # (past the end: waste)
        history = self.prompt + stats.token_ids
        if self.lookup is not None:
            found = self.lookup.propose(history, left)
            k = min(fixed or pacer.k(0.0, found.kind, len(found.tokens)), left) if found.tokens else 0
            return found, Draft(found.tokens[:k], kind=found.kind)
        assert spec.draft is not None
        k = min(fixed or pacer.k(spec.draft.step_ms), left)
        if k <= 0:
            return Draft([]), Draft([])
        vocab = self.backend.manifest.vocab_size
        return Draft([]), await spec.draft.propose(self.session, history, k,
                                                   lambda logits: reply.draw(logits, vocab))
