"""Several sessions' decode steps through one layer range as one batched run.

Decode is bound by streaming the weights: a stage running four sessions' tokens in one batch
reads its weights once instead of four times. Sessions hold KV of different lengths, so each
past is left-padded with zeros to the longest, and the attention mask hides the padding (the
exported layers take a (batch, past + seq) mask; padded and unpadded runs agree exactly, checked
in tests/test_batch.py). Padding and splitting copy the sessions' KV, which is why a node batches
only while that copy stays under its configured size.
"""

from __future__ import annotations

import numpy as np

from edgelite.engine.runtime import KVCache, LayerRange


def padded_bytes(kvs: list[KVCache]) -> int:
    """Bytes of KV a batch of these sessions copies (padded to the longest, in and out)."""
    per_token = 2 * sum(k.shape[1] * k.shape[3] * k.itemsize for k in kvs[0].keys)
    return 2 * len(kvs) * (max(kv.length for kv in kvs) + 1) * per_token


def run_batch(layers: LayerRange, hiddens: list[np.ndarray], kvs: list[KVCache],
              starts: list[int]) -> tuple[list[np.ndarray], list[KVCache]]:
    """Decode steps (each hidden (1, 1, hidden_size), at its session's `start`) of different
    sessions together; per session, its output and its grown KV cache."""
    n, longest = len(kvs), max(starts)
    pads = [longest - s for s in starts]

    def stack(per_session: list[np.ndarray]) -> np.ndarray:
        _, heads, _, dim = per_session[0].shape
        out = np.zeros((n, heads, longest, dim), np.float32)
        for i, a in enumerate(per_session):
            out[i, :, pads[i]:, :] = a[0]
        return out

    keys = [stack([kv.keys[j] for kv in kvs]) for j in range(len(layers.sessions))]
    values = [stack([kv.values[j] for kv in kvs]) for j in range(len(layers.sessions))]
    mask = np.ones((n, longest + 1), np.int64)
    for i, p in enumerate(pads):
        mask[i, :p] = 0
    pos = np.array(starts, np.int64).reshape(n, 1)
    out, grown = layers.run(np.concatenate(hiddens, axis=0), KVCache(keys, values), pos, mask)
    # copies: a view would keep the whole batch's arrays alive for as long as any session lives
    caches = [KVCache([k[i:i + 1, :, pads[i]:, :].copy() for k in grown.keys],
                      [v[i:i + 1, :, pads[i]:, :].copy() for v in grown.values])
              for i in range(n)]
    return [out[i:i + 1] for i in range(n)], caches
