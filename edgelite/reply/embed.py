"""Embeddings (OpenAI's /v1/embeddings, `LLM.embed`): a text's vector is the mean over its
positions of the model's last hidden states after the final norm, scaled to length 1, as
llama-server's `--embeddings --pooling mean` makes it.

The text goes through the model in chunks, in a session of its own that is ended afterwards
(Backend.hidden: the same pipeline a reply's prompt takes; no token is generated). Causal
attention makes each position's state depend on the positions before it only, so the chunks
give the states one pass over the whole text would.
"""

from __future__ import annotations

import secrets

import numpy as np

from edgelite.errors import EdgeliteError
from edgelite.reply.backend import Backend
from edgelite.reply.driver import ReplyDriver


class Pool:
    """The running sum of a text's normed hidden states."""

    def __init__(self, hidden_size: int) -> None:
        self.total = np.zeros(hidden_size, np.float64)
        self.count = 0

    def add(self, rows: np.ndarray) -> None:
        """rows (n, hidden_size), the next n positions' states."""
        if rows.ndim != 2 or rows.shape[1] != len(self.total):
            raise EdgeliteError(f"hidden states of shape {rows.shape}; expected (n, "
                                f"{len(self.total)})")
        self.total += rows.sum(axis=0, dtype=np.float64)
        self.count += rows.shape[0]

    def reset(self) -> None:
        self.total[:] = 0.0
        self.count = 0

    def vector(self) -> np.ndarray:
        """The mean, normalised to length 1 (float32)."""
        if not self.count:
            raise EdgeliteError("nothing to embed: the text has no tokens")
        mean = self.total / self.count
        norm = float(np.linalg.norm(mean))
        return (mean / norm if norm > 0 else mean).astype(np.float32)


async def embed(backend: Backend, ids: list[int], chunk: int) -> np.ndarray:
    """The embedding of token ids, computed `chunk` tokens a step (within one step's chunk)."""
    if not ids:
        raise EdgeliteError("nothing to embed: the text has no tokens")
    if len(ids) > backend.context:
        raise EdgeliteError(f"the text has {len(ids)} tokens; at most {backend.context} fit")
    pool = Pool(backend.manifest.hidden_size)
    driver = ReplyDriver(None, ids, pool=pool)
    session = "embed-" + secrets.token_hex(8)
    try:
        while not driver.done:
            call = driver.next_call(chunk)
            driver.took(call, await backend.hidden(session, np.array([call.ids], np.int64)))
    finally:
        await backend.end(session)
    return pool.vector()
