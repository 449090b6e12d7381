"""What a reply runs on: a model backend, the local chain (client/local.py) or a cluster
(client/backend.py), maps (session, new token ids) to the logits of the last position, keeping
the session's KV wherever its layers live. The reply side (this package) drives one through
this protocol and knows nothing of ONNX."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

import numpy as np

from edgelite.errors import NodeError, NodeUnavailable
from edgelite.manifest import Manifest
from edgelite.reply.driver import Call


class Backend(Protocol):
    manifest: Manifest

    async def forward(self, session: str, ids: np.ndarray) -> np.ndarray:
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
        """The session keeps its first n positions (at most config.MAX_ROLLBACK fewer than it
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


def stored_kv_failed(exc: BaseException) -> bool:
    """Whether the first step after a restore failed because a stage could not use the KV it
    had found (its entry failed the checks when read: a node refused the step) rather than
    because a node was lost: the prompt is then computed instead."""
    return isinstance(exc, NodeError) and not isinstance(exc, NodeUnavailable)


def run(backend: Backend, session: str, call: Call) -> Awaitable[np.ndarray]:
    """A reply driver's call (reply/driver.py) on a backend."""
    batch = np.array([call.ids], np.int64)
    if call.kind == "verify":
        return backend.verify(session, batch)
    if call.kind == "hidden":
        return backend.hidden(session, batch)
    return backend.forward(session, batch)
