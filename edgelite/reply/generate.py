"""`generate`: one reply over a Backend (reply/backend.py), driven by one ReplyDriver
(reply/driver.py: what to run next and what its result means): the prompt's longest stored
prefix imported, the rest prefilled in one step (the backend cuts it in chunks), then decode
steps or speculative rounds (reply/speculate.py), the conversation's KV stored at the end."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator

from edgelite.config import GenerationConfig
from edgelite.errors import EdgeliteError, NodeError
from edgelite.reply.backend import Backend, run, stored_kv_failed
from edgelite.reply.driver import ReplyDriver
from edgelite.reply.loop import Piece, ReplyLoop, Stats, fitted
from edgelite.reply.speculate import Draft, Lookup, Speculation
from edgelite.reply.tokenizer import StreamDecoder

log = logging.getLogger(__name__)


async def generate(backend: Backend, prompt: list[int], cfg: GenerationConfig,
                   stats: Stats | None = None, session: str | None = None, reuse: bool = True,
                   decoder: StreamDecoder | None = None,
                   speculation: Speculation | None = None) -> AsyncIterator[Piece]:
    """Yield the reply's pieces (reply/loop.py: its rules end it); fills `stats` as it goes.
    `decoder` gives the pieces text (None: ids only). With `reuse`, the prompt's longest stored
    prefix is imported from the KV stores instead of computed, and the conversation's KV is
    stored when the reply ends. With `speculation`, decode steps verify drafts (see
    reply/speculate.py; the output is the same)."""
    if not prompt:
        raise EdgeliteError("the prompt is empty (no tokens to start from)")
    cfg = fitted(cfg, len(prompt), backend.context, backend.manifest, "the KV this engine holds")
    reply = ReplyLoop(cfg, backend.manifest.eos_token_ids, decoder, stats=stats, prompt=prompt)
    reply.stats.prompt_tokens = len(prompt)
    draft = speculation.draft if speculation is not None else None
    lookup = Lookup() if speculation is not None and draft is None else None
    driver = ReplyDriver(reply, prompt, lookup, speculation.pacer.fork() if speculation is not None else None)
    session = session or secrets.token_hex(16)
    ok = False
    try:
        if reuse and len(prompt) > 1:
            driver.imported(await backend.restore(session, driver.wanted()))
        if draft is None:
            pieces = await _prefill(backend, session, driver)
        else:  # the draft computes the prompt meanwhile
            try:
                async with asyncio.TaskGroup() as tg:
                    target = tg.create_task(_prefill(backend, session, driver))
                    tg.create_task(draft.prepare(session, prompt))
            except ExceptionGroup as group:  # (the first failure, as a plain step raises it)
                raise group.exceptions[0] from None
            pieces = target.result()
        for piece in pieces:
            yield piece
        while not driver.done:
            for piece in await _round(backend, session, driver, speculation):
                yield piece
        ok = True
    except GeneratorExit:  # the caller stopped reading (Ctrl-C): the KV is sound
        ok = True
        raise
    finally:
        if reuse and ok and driver.fed:
            await backend.save(session, driver.fed)
        await backend.end(session)
        if draft is not None:
            await draft.end(session)


async def _prefill(backend: Backend, session: str, driver: ReplyDriver) -> list[Piece]:
    """The prompt's step after what was imported from the KV stores: the first piece."""
    call = driver.next_call()
    try:
        logits = await run(backend, session, call)
    except NodeError as exc:
        if not driver.restored or not stored_kv_failed(exc):
            raise
        # a stage could not use its stored KV after all (an entry failed its checks when
        # read): the prompt is computed instead
        log.warning("the stored KV of the prompt's first %d tokens was not usable; computing them",
                    driver.restored)
        await backend.end(session)
        driver.unusable()
        call = driver.next_call()
        logits = await run(backend, session, call)
    return driver.took(call, logits).pieces


async def _round(backend: Backend, session: str, driver: ReplyDriver,
                 spec: Speculation | None) -> list[Piece]:
    """One decode round: a plain step, or the verification of the drafts the pacer asks for
    (a draft model's, or the lookup's inside the driver), the refused positions given back."""
    draft = None
    if spec is not None and spec.draft is not None and driver.reply is not None:
        k, reply, vocab = driver.draft_count(spec.draft.step_ms), driver.reply, backend.manifest.vocab_size
        draft = Draft([]) if k <= 0 else await spec.draft.propose(
            session, driver.prompt + driver.tokens, k, lambda logits: reply.draw(logits, vocab))
    call = driver.next_call(draft=draft)
    t0 = time.perf_counter()
    result = await run(backend, session, call)
    ms = (time.perf_counter() - t0) * 1e3
    out = driver.took(call, result)
    if driver.pacer is not None:
        offered = len(call.drafts.tokens)
        driver.pacer.timed(offered, ms, None if offered else backend.step_compute_ms)
    if out.rollback is not None:
        await backend.rollback(session, out.rollback)
    return out.pieces
