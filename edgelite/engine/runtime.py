"""The model pieces a device runs: the embedding, the head, a client's part of a plan, and the
whole model in one process (the local engine).

Prompts run in chunks (`chunks_of`): at most the largest size of the configured chunk list per
step, so attention never materialises (prompt x prompt) scores and shapes stay few.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from edgelite.config import RuntimeConfig
from edgelite.engine import onnxgraph
from edgelite.engine.kv import Slot
from edgelite.engine.kvstore import KVStore, open_store
from edgelite.engine.layers import LayerRange, ModelFiles, export_files
from edgelite.engine.passes import linear, pipeline
from edgelite.engine.passes.base import apply
from edgelite.engine.session import open_model
from edgelite.errors import EdgeliteError, ModelFileError
from edgelite.manifest import FileEntry, Manifest
from edgelite.paths import home
from edgelite.topk import largest


def chunks_of(n: int, sizes: tuple[int, ...], overhead: int = 0, stages: int = 1,
              min_cap: int = 0) -> Iterator[tuple[int, int]]:
    """(start, end) of each chunk of a prompt of n tokens: chunks of a cap size while more than
    it is left, then the cut of the rest that runs the fewest padded tokens (each chunk costs
    `overhead` tokens more: a call, a hop; a single token is a decode step, a shape every
    session has). E.g. sizes (16, 64, 256): 35 -> 16+16+1+1+1 (not 16+16+3 padded to 16, nor
    one 64); 60 -> 60 (one chunk of 64). The shortest steps go last: a pipeline's stages work on
    a prompt's chunks in turn, so the last chunk's time after the first stage is the wait.

    The cap: through a pipeline of `stages` stages of equal speed, chunks taking c_1..c_k each
    at every stage are done after sum(c) + (stages - 1) * max(c) (the pipeline fills with the
    first chunks and drains with the last). One stage: the largest size; more: smaller chunks
    keep the stages busy together. The cap is the size (of those >= `min_cap`, or the
    smallest) with the least estimated time, the larger on a tie."""
    sizes = tuple(sorted(sizes))
    best: tuple[int, tuple[int, ...]] | None = None
    for i, cap in enumerate(sizes):
        if cap < min_cap and cap != sizes[-1]:
            continue
        full, rest = divmod(n, cap)
        if full and not rest:  # (n a multiple of the cap: the last full chunk is the rest)
            full, rest = full - 1, cap
        cut = (cap,) * full + tuple(sorted(_cut(rest, sizes[:i + 1], overhead), reverse=True))
        costs = [_pad(c, sizes) + overhead for c in cut]
        cost = sum(costs) + (stages - 1) * max(costs, default=0)
        if best is None or cost <= best[0]:
            best = (cost, cut)
        if n <= cap:  # larger caps cut it the same way (a decode step stops at the first)
            break
    a = 0
    for size in best[1] if best else ():
        yield a, a + size
        a += size


@functools.lru_cache(maxsize=4096)
def _cut(rest: int, sizes: tuple[int, ...], overhead: int) -> tuple[int, ...]:
    """The chunk lengths for `rest` <= sizes[-1] tokens (whole sizes or single tokens first,
    the padded one last) with the fewest padded tokens + overhead per chunk."""
    if rest <= 0:
        return ()
    best = (_pad(rest, sizes) + overhead, (rest,))
    for c in (*reversed(sizes), 1):  # (on a tie, the longer whole chunk)
        if c < rest:
            tail = _cut(rest - c, sizes, overhead)
            cost = c + overhead + sum(_pad(k, sizes) + overhead for k in tail)
            if cost < best[0]:
                best = (cost, (c, *tail))
    return best[1]


def _pad(k: int, sizes: tuple[int, ...]) -> int:
    """The tokens a chunk of k runs as (a single token is a decode step)."""
    return 1 if k == 1 else sizes[bisect.bisect_left(sizes, k)]


class _Piece:
    def __init__(self, manifest: Manifest, entry: FileEntry, cfg: RuntimeConfig, files: ModelFiles,
                 what: str, products: bool = False) -> None:
        """`products`: its MatMulNBits by edgelite's product operators where they can (linear.py)."""
        library = linear.library(cfg) if products else None
        chosen = pipeline.for_piece(manifest, entry, cfg, library)
        self.passes = [p.name for p in chosen]
        model = apply(onnxgraph.relocated(files.graph(entry), files.locate), chosen)
        self.session: Any = open_model(model, files.folder, cfg, f"{what} of {manifest.name}", library,
                                       linear.RESIDENT if library else ())

    def check_output(self, name: str, axis: int, field: str, value: int) -> None:
        """A fixed dimension of an output against the manifest (which must match its files)."""
        shape = next((o.shape for o in self.session.get_outputs() if o.name == name), None)
        if shape is None:
            raise ModelFileError(f"the graph has no output {name}")
        if axis < len(shape) and isinstance(shape[axis], int) and shape[axis] != value:
            raise ModelFileError(f"the manifest says {field} = {value}, but the graph's {name} "
                                 f"has {shape[axis]} there (dims {shape})")


class Embedding(_Piece):
    def __init__(self, manifest: Manifest, cfg: RuntimeConfig, files: ModelFiles) -> None:
        super().__init__(manifest, manifest.embed, cfg, files, "the embedding")
        self.check_output("hidden_0", 2, "hidden_size", manifest.hidden_size)
        self.vocab = manifest.vocab_size

    def run(self, ids: np.ndarray) -> np.ndarray:
        """ids (batch, seq) -> hidden (batch, seq, hidden_size)."""
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab):
            raise EdgeliteError(f"token ids must be in 0..{self.vocab - 1}; got "
                                f"{int(ids.min())}..{int(ids.max())}")
        return self.session.run(None, {"input_ids": ids.astype(np.int64, copy=False)})[0]


class ExactRows:
    """The head's block rows, read from its data file on demand, to recompute the best
    candidates of a fast head exactly: the greedy token (and every token worth sampling) then
    comes from exact logits, while the full vocabulary costs the fast int8-activation product."""

    def __init__(self, spec: dict, path: Path, k: int) -> None:
        rows, cols, self.bits, self.block = spec["rows"], spec["cols"], spec["bits"], spec["block"]
        q_off, _ = spec["qweight"]
        # codes at their own width (8 codes in `width` bytes, less `low`), or in their storage
        self.width, self.low = int(spec.get("code_width", 0)), int(spec.get("code_low", 0))
        row_bytes = cols * self.width // 8 if self.width else cols if self.bits == 8 else cols // 2
        self.q = np.memmap(path, np.uint8, "r", q_off, (rows, row_bytes))
        blocks = cols // self.block
        self.base = self.scales = None
        if "scale_base" in spec:  # a K-quant's float16 per super-block x integer per block
            b_off, b_len, _ = spec["scale_base"]
            m_off, _, mult = spec["scale_mult"]
            self.base = np.memmap(path, np.float16, "r", b_off, (rows, b_len // 2 // rows))
            self.mult = np.memmap(path, np.dtype(mult), "r", m_off, (rows, blocks))
            self.factor = np.float32(spec["scale_factor"])
        else:
            s_off, _, dtype = spec["scales"]
            self.scales = np.memmap(path, np.dtype(dtype), "r", s_off, (rows, blocks))
        self.zero, self.k = float(spec["zero"]), k

    def _row_scales(self, top: np.ndarray) -> np.ndarray:
        """(len(top), blocks) float32 scales of those rows."""
        if self.scales is not None:
            return self.scales[top].astype(np.float32)
        assert self.base is not None
        per = self.mult.shape[1] // self.base.shape[1]
        s = np.repeat(self.base[top].astype(np.float32), per, axis=1) * self.mult[top].astype(np.float32)
        return s * self.factor if self.factor != 1 else s

    def _widen(self, stream: np.ndarray) -> np.ndarray:
        """(rows, cols * width / 8) bytes -> (rows, cols) codes."""
        rows, w = len(stream), self.width
        words = np.zeros((rows, stream.shape[1] // w, 8), np.uint8)
        words[:, :, :w] = stream.reshape(rows, -1, w)
        word = words.view("<u8")  # (rows, groups, 1): the first code in the lowest bits
        codes = (word >> (np.arange(8, dtype=np.uint64) * np.uint64(w))) & np.uint64((1 << w) - 1)
        return codes.reshape(rows, -1).astype(np.uint8) + np.uint8(self.low)

    def rescore(self, normed: np.ndarray, logits: np.ndarray) -> None:
        """logits (vocab,) of the fast head: its top k replaced by exact ones, in place."""
        top = largest(logits, self.k)
        q = self.q[top]
        if self.width:
            q = self._widen(q)
        elif self.bits == 4:
            q = np.stack([q & 15, q >> 4], axis=-1).reshape(len(top), -1)
        w = (q.astype(np.float32) - self.zero) * np.repeat(self._row_scales(top), self.block, axis=1)
        logits[top] = w @ normed


class Head(_Piece):
    def __init__(self, manifest: Manifest, cfg: RuntimeConfig, files: ModelFiles) -> None:
        super().__init__(manifest, manifest.head, cfg, files, "the head", products=True)
        self.check_output("logits", 2, "vocab_size", manifest.vocab_size)
        spec = manifest.quantization.get("exact_head")
        self.exact = None
        if spec and cfg.exact_head_candidates > 0:
            self.exact = ExactRows(spec, files.folder / files.locate(spec["file"]),
                                   cfg.exact_head_candidates)

    def normed(self, hidden: np.ndarray) -> np.ndarray:
        """hidden (batch, seq, hidden_size) -> the final norm's output, the same shape (what
        embeddings pool)."""
        return self.session.run(["normed"], {"hidden": np.ascontiguousarray(hidden)})[0]

    def run(self, hidden: np.ndarray) -> np.ndarray:
        """hidden (batch, seq, hidden_size) -> logits (batch, seq, vocab)."""
        normed, logits = self.session.run(["normed", "logits"], {"hidden": np.ascontiguousarray(hidden)})
        if self.exact is not None:
            for b in range(logits.shape[0]):
                for s in range(logits.shape[1]):
                    self.exact.rescore(normed[b, s], logits[b, s])
        return logits


class ClientPart:
    """What the client runs of a plan: the embedding, its own prefix of the layers (if any)
    and the head. One thread uses it (the client's step plane)."""

    def __init__(self, manifest: Manifest, cfg: RuntimeConfig,
                 layers: tuple[int, int] | None = None, files: ModelFiles | None = None) -> None:
        files = files or export_files(manifest, cfg.verify_hashes)
        self.manifest, self.cfg = manifest, cfg
        self.embed = Embedding(manifest, cfg, files)
        self.head_ = Head(manifest, cfg, files)
        self.prefix = LayerRange(manifest, *layers, cfg, files) if layers else None
        self.slots: dict[str, Slot] = {}
        self.restoring: dict[str, Slot] = {}  # slots being filled from the KV store
        # its layers' KV on disk (a node stage keeps its own)
        self.store: KVStore | None = open_store(cfg.kv_store, home() / "kv") if layers else None

    @property
    def max_chunk(self) -> int:
        """The most tokens one step carries (a prompt goes in chunks of this)."""
        return max(self.cfg.prefill_chunks)

    def close(self) -> None:
        """Let go of its sessions and KV (its plan ended: a failover loads the next one, whose
        memory then counts once, not beside this one's)."""
        if self.prefix is not None:
            self.prefix.close()
        self.prefix = None
        self.slots.clear()
        self.restoring.clear()
        self.embed.session = self.head_.session = None

    def front(self, session: str, ids: np.ndarray) -> np.ndarray:
        """ids (1, n) -> the hidden state the first node stage takes (n within one chunk)."""
        hidden = self.embed.run(ids)
        if self.prefix is None:
            return hidden
        slot = self.slots.get(session)
        if slot is None:
            slot = self.slots[session] = self.prefix.pool.acquire()
        return self.prefix.run(slot, hidden)

    def head(self, hidden: np.ndarray) -> np.ndarray:
        """The last stage's output (1, seq, hidden) -> logits (vocab,) of the last position."""
        return self.head_.run(hidden[:, -1:, :])[0, 0]

    def head_all(self, hidden: np.ndarray) -> np.ndarray:
        """The last stage's output (1, seq, hidden) -> logits (seq, vocab) at every position
        (a speculative step's verification)."""
        return self.head_.run(hidden)[0]

    def normed_all(self, hidden: np.ndarray) -> np.ndarray:
        """The last stage's output (1, seq, hidden) -> (seq, hidden) the final norm's output
        at every position (Backend.hidden)."""
        return self.head_.normed(hidden)[0]

    def rollback(self, session: str, n: int) -> None:
        """The session keeps its first n positions in this part's layers (kv.MAX_ROLLBACK)."""
        slot = self.slots.get(session)
        if self.prefix is not None and slot is not None:
            self.prefix.pool.rollback(slot, n)

    def heads(self, hiddens: list[np.ndarray]) -> np.ndarray:
        """Several sessions' last-stage outputs (1, seq_i, hidden) -> logits (n, vocab) of each
        one's last position, as one run: the head's weights are read once for all of them."""
        if len(hiddens) == 1:
            return self.head(hiddens[0])[None]
        return self.head_.run(np.concatenate([h[:, -1:, :] for h in hiddens]))[:, 0]

    def end(self, session: str) -> None:
        slot = self.slots.pop(session, None)
        if slot is not None and self.prefix is not None:
            self.prefix.pool.release(slot)

    def export_kv(self, session: str, n: int) -> np.ndarray:
        """A copy of the session's KV of its first n positions in this part's layers."""
        slot = self.slots.get(session)
        if self.prefix is None or slot is None:
            raise EdgeliteError(f"session {session[:12]} holds no KV here")
        return self.prefix.pool.read(slot, n)

    def reserve(self, session: str) -> Slot:
        """A new slot for the session to be filled from the KV store (`view` of it, off this
        thread), then made the session's by `attach` or freed by `abandon`; the session's
        current KV, if any, is dropped."""
        assert self.prefix is not None
        if session in self.restoring:
            raise EdgeliteError(f"session {session[:12]} is being restored already")
        self.end(session)
        slot = self.prefix.pool.acquire()
        self.restoring[session] = slot
        return slot

    def attach(self, session: str, slot: Slot, n: int) -> int:
        """The reserved slot, filled with n positions, becomes the session's; returns n."""
        if self.restoring.get(session) is not slot:
            raise EdgeliteError(f"session {session[:12]} has no such reserved slot")
        del self.restoring[session]
        self.end(session)
        slot.length = n
        self.slots[session] = slot
        return n

    def abandon(self, session: str, slot: Slot) -> None:
        """A reserved slot that was not filled is freed."""
        assert self.prefix is not None
        if self.restoring.get(session) is slot:
            del self.restoring[session]
        self.prefix.pool.release(slot)

    def reset(self) -> None:
        """Forget every session (the stages lost theirs: the plan is deployed again)."""
        for session in list(self.slots):
            self.end(session)


class LocalChain:
    """The whole model in one process: the reference engine."""

    def __init__(self, manifest: Manifest, cfg: RuntimeConfig | None = None) -> None:
        cfg = cfg or RuntimeConfig()
        self.manifest = manifest
        self.part = ClientPart(manifest, cfg, (0, manifest.num_layers - 1))
        assert self.part.prefix is not None
        self.layers = self.part.prefix

    def forward(self, session: str, ids: np.ndarray) -> np.ndarray:
        """ids (1, n) appended to the session -> logits (vocab,) of the last position."""
        hidden = None
        for a, b in chunks_of(ids.shape[1], self.layers.chunks, self.part.cfg.chunk_overhead_tokens):
            hidden = self.part.front(session, ids[:, a:b])
        assert hidden is not None
        return self.part.head(hidden)

    def verify(self, session: str, ids: np.ndarray) -> np.ndarray:
        """ids (1, n), n within one chunk, appended in one run -> logits (n, vocab)."""
        return self.part.head_all(self.part.front(session, ids))

    def hidden(self, session: str, ids: np.ndarray) -> np.ndarray:
        """ids (1, n), n within one chunk, appended in one run -> (n, hidden) normed."""
        return self.part.normed_all(self.part.front(session, ids))

    def rollback(self, session: str, n: int) -> None:
        self.part.rollback(session, n)

    def logits_all(self, session: str, ids: np.ndarray) -> np.ndarray:
        """ids (1, n) appended to the session -> logits (n, vocab) at every position."""
        out = []
        for a, b in chunks_of(ids.shape[1], self.layers.chunks, self.part.cfg.chunk_overhead_tokens):
            out.append(self.part.head_.run(self.part.front(session, ids[:, a:b]))[0])
        return np.concatenate(out)

    def length(self, session: str) -> int:
        slot = self.part.slots.get(session)
        return slot.length if slot else 0

    def end(self, session: str) -> None:
        self.part.end(session)
