"""Generation: a model backend (local chain or remote cluster) + sampling, streaming tokens.

A backend maps (session, new token ids) -> logits of the last position, keeping the session's
KV cache wherever its layers live. The engine owns no UI.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from edgelite.config import GenerationConfig, RuntimeConfig
from edgelite.engine.runtime import LocalChain
from edgelite.engine.sampling import sample
from edgelite.manifest import Manifest


class Backend(Protocol):
    manifest: Manifest

    async def step(self, session: str, ids: np.ndarray) -> np.ndarray:
        """ids (1, seq) appended to the session -> logits (vocab,) of the last position."""
        ...

    async def end(self, session: str) -> None:
        """Free the session's KV everywhere."""
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

    async def close(self) -> None:
        self.pool.shutdown(wait=True)

    @property
    def healthy(self) -> bool:
        return True  # nothing here can be lost

    async def reopen(self) -> None:
        """Nothing to set up again."""


@dataclass
class Stats:
    prompt_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    ttft_ms: float = 0.0
    decode_s: float = 0.0
    finish: str = "length"

    @property
    def decode_tok_s(self) -> float:
        n = len(self.token_ids) - 1  # the first token comes from prefill
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


async def generate(backend: Backend, prompt: list[int], cfg: GenerationConfig,
                   stats: Stats | None = None, session: str | None = None) -> AsyncIterator[int]:
    """Yield generated token ids until EOS or max_tokens; fills `stats` as it goes."""
    stats = stats if stats is not None else Stats()
    stats.prompt_tokens = len(prompt)
    session = session or secrets.token_hex(16)
    eos = set(backend.manifest.eos_token_ids)
    rng = np.random.default_rng(cfg.seed if cfg.seed is not None else secrets.randbits(64))
    t0 = time.perf_counter()
    ids = np.array([prompt], np.int64)
    try:
        for i in range(cfg.max_tokens):
            logits = await backend.step(session, ids)
            tok = sample(logits, cfg.temperature, cfg.top_p, rng)
            now = time.perf_counter()
            if tok in eos:
                stats.finish = "eos"
                return
            if i == 0:
                stats.ttft_ms, t_first = (now - t0) * 1e3, now
            stats.decode_s = now - t_first
            stats.token_ids.append(tok)
            yield tok
            ids = np.array([[tok]], np.int64)
    finally:
        await backend.end(session)
