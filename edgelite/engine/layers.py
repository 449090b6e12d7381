"""A contiguous range of decoder layers as a few onnxruntime sessions, with its sessions' KV.

Consecutive layer graphs are joined into one graph (onnxgraph.py) up to
`RuntimeConfig.session_weights_mb` of weights each: one session runs many small layers with the
fewest calls, and a session's load, which widens its compact scales in memory all at once,
stays bounded (measured on a 1 B model: 8 layers in one session peaked 155 MiB above what they
then hold; one a session, 20 MiB). The sessions of a range run one after another, each reading
the previous one's output buffer. A step binds, in place,
each layer's KV buffer of the session's slot as both past and present (kv.py), so nothing is
copied or concatenated. Steps have bounded shapes: a decode step is one token; a prompt chunk
is padded up to the next size of the chunk list (its padded positions land past the session's
real length and are overwritten by later steps; attention is causal, so they never reach a real
token). Bindings are cached per (slab, slots, chunk): a step only writes its inputs into
buffers the binding already points to.

One thread uses a LayerRange at a time (the node's data plane, or the local engine's worker).
A step far past what the range's own steps take is cancelled (engine/deadline.py).
"""

from __future__ import annotations

import bisect
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from edgelite import heap
from edgelite.config import RuntimeConfig
from edgelite.engine import kernels, onnxgraph, rope
from edgelite.engine.deadline import StepClock, run_guarded
from edgelite.engine.kv import KVPool, Slab, Slot
from edgelite.engine.kvfile import Layout
from edgelite.engine.passes import linear, pipeline
from edgelite.engine.passes.base import apply
from edgelite.engine.session import open_model
from edgelite.errors import EdgeliteError, KVBudgetExceeded, ModelFileError
from edgelite.manifest import FileEntry, Manifest, check_file, kv_row_values


@dataclass(frozen=True)
class ModelFiles:
    """Where a model's files are: each graph, and the folder onnxruntime reads weights from
    (`locate` gives a data file's name there from its name in the manifest)."""

    folder: Path
    graph: Callable[[FileEntry], bytes]
    locate: Callable[[str], str]


def export_files(manifest: Manifest, verify: bool = True) -> ModelFiles:
    """The files of an export folder, each checked (size, and sha256 when `verify`)."""
    checked: set[str] = set()

    def graph(e: FileEntry) -> bytes:
        for d in e.data:
            if d.file not in checked:
                check_file(manifest.path(d), d.sha256, d.bytes, verify)
                checked.add(d.file)
        return check_file(manifest.path(e), e.sha256, e.bytes, verify).read_bytes()

    listed = {d.file for e in manifest.files for d in e.data}  # (plain names: manifest.py checks)

    def locate(name: str) -> str:
        """A graph's data file, only if the manifest lists it: never a path out of the folder."""
        if name not in listed:
            raise ModelFileError(f"a graph names data file {name[:200]!r}, which its manifest does "
                                 f"not list (a model's weights are read from its own folder only)")
        return name

    return ModelFiles(manifest.root, graph, locate)


@dataclass
class Binding:
    """Cached IOBindings, one per session of the range, and the buffers they point to (written
    before each run; each session's output is the next one's input)."""

    io: list[Any]
    hidden: np.ndarray  # (rows, chunk, hidden)
    seqlens: np.ndarray  # (rows,) int32
    total: np.ndarray  # () int32
    out: np.ndarray  # (rows, chunk, hidden)
    between: list[np.ndarray] = field(default_factory=list)  # outputs of all sessions but the last
    runs: list[tuple[Any, Any]] = field(default_factory=list)  # (session, its binding), in order

    def __post_init__(self) -> None:
        # the same buffers as flat memoryviews: a decode step (decode_bytes) writes its input
        # and reads its output through these, in single C calls
        self.hidden_bytes = memoryview(self.hidden).cast("B")
        self.out_bytes = memoryview(self.out).cast("B")
        self.seqlens_mv = memoryview(self.seqlens)
        self.total_mv = memoryview(self.total.reshape(1))


@dataclass
class LayerRange:
    manifest: Manifest
    first: int
    last: int
    cfg: RuntimeConfig
    files: ModelFiles
    bindings: dict[tuple[int, int, int, int], Binding] = field(default_factory=dict)
    passes: list[str] = field(default_factory=list)  # the graph passes it loaded with (passes/pipeline.py)

    def __post_init__(self) -> None:
        m = self.manifest
        self.kv_dtype = m.kv_dtype(self.cfg.kv_dtype, self.cfg.invariant)
        if self.kv_dtype != "float32" and not self.cfg.invariant:
            raise EdgeliteError(f"a {self.kv_dtype} KV needs the invariant attention "
                                "(drop --no-invariant, or use --kv-dtype float32)")
        # invariant: attention by edgelite's own operator where it could be built (the
        # library, engine/kernels), else for a 16-bit KV in onnxruntime's plain operators
        # over the valid KV (engine/passes/attention.py) and for float32 its GroupQueryAttention with
        # one-row steps padded to two rows (engine/passes/invariant.py); not invariant:
        # GroupQueryAttention as it is, batching decode steps of several sessions
        attend = self.cfg.invariant and self.cfg.attention_kernel and m.head_dim in kernels.HEAD_DIMS
        self.library = kernels.library(self.cfg) if attend else None
        # fast-mode narrow products by the same library where it has their vector path
        self.matmul = linear.library(self.cfg)
        self.plain = self.library is not None or self.kv_dtype != "float32"
        # decode steps of several sessions may run as one batch: not invariant, or where each
        # row of a batch is computed as alone (the attention in edgelite's operator, every
        # product edgelite's, whose row tiles are row-invariant, or a float MatMul)
        self.batchable = not self.cfg.invariant or (
            self.library is not None and (m.weights == "fp32" or linear.narrow(self.cfg, m)))
        if not 0 <= self.first <= self.last < m.num_layers:
            raise EdgeliteError(f"layer range {self.first}-{self.last} is outside 0-{m.num_layers - 1}")
        entries = m.layers[self.first:self.last + 1]
        self.groups = groups(entries, self.first, self.cfg.session_weights_mb << 20)
        self.sessions = [self._open(lo, hi) for lo, hi in self.groups]
        self.chunks = tuple(sorted(self.cfg.prefill_chunks))
        context = min(m.max_positions, max(self.cfg.kv_buckets))
        extra = self.cfg.invariant and not self.plain  # (a padded step writes one position more)
        if self.kv_dtype == "int8" and self.library is None:
            raise EdgeliteError("an int8 KV needs the attention kernel (a C compiler, and without "
                                "--no-attention-kernel or --no-invariant); use --kv-dtype float16")
        self.row = kv_row_values(self.kv_dtype, m.head_dim)  # (int8: its step's bytes too)
        self.pool = KVPool(self.last - self.first + 1, m.num_kv_heads, self.row,
                           context + self.chunks[-1] + extra, self.cfg.kv_slab_slots, self.cfg.kv_buckets,
                           tuple(e.window for e in entries), self.chunks[-1], context,
                           self.kv_dtype)
        inputs = {i.name for s in self.sessions for i in s.get_inputs()}
        self.ropes: dict[str, np.ndarray] = {}  # RoPE table inputs the graph has -> their tables
        for suffix, local in (("", False), ("_local", True)):
            if f"cos_cache{suffix}" in inputs:
                cos, sin = rope.tables(m, self.pool.capacity, local)
                self.ropes |= {f"cos_cache{suffix}": cos, f"sin_cache{suffix}": sin}
        self.hidden_in = f"hidden_{self.first}"
        self._check_shapes()
        # a step far past what this range's steps take is cancelled (engine/deadline.py)
        self.clock = StepClock(self.cfg.step_deadline_s, self.cfg.step_deadline_factor)
        self.run_options = ort.RunOptions()

    def _open(self, lo: int, hi: int) -> Any:
        m = self.manifest
        entries = m.layers[lo:hi + 1]
        model = onnxgraph.join([self.files.graph(e) for e in entries], self.files.locate,
                               f"layers_{lo}_{hi}", [e.file for e in entries])
        chosen = pipeline.for_range(m, entries, self.cfg, self.kv_dtype, self.library, self.matmul)
        self.passes = [p.name for p in chosen]
        model = apply(model, chosen)
        return open_model(model, self.files.folder, self.cfg, f"layers {lo}-{hi} of {m.name}",
                          self.library or self.matmul, linear.RESIDENT if self.matmul else ())

    def _check_shapes(self) -> None:
        """The graphs' fixed input dimensions against the manifest (a manifest that disagrees
        with its files would fail only at the first step, or compute garbage)."""
        m = self.manifest
        if not self.ropes:
            raise ModelFileError(f"layers {self.first}-{self.last}: the graph has no RoPE table input")
        want: dict[str, dict[int, tuple[str, int]]] = {
            self.hidden_in: {2: ("hidden_size", m.hidden_size)},
            **{name: {1: ("rope (rotary dimension / 2)", m.rotary_dim // 2)} for name in self.ropes}}
        for j in range(self.first, self.last + 1):
            for kind in ("key", "value"):
                want[f"past_{kind}_{j}"] = {1: ("num_kv_heads", m.num_kv_heads),
                                             3: ("head_dim", self.row)}
        got = {i.name: i.shape for s in self.sessions for i in s.get_inputs()}
        for name, dims in want.items():
            shape = got.get(name)
            if shape is None:
                raise ModelFileError(f"layers {self.first}-{self.last}: the graph has no input {name}")
            for axis, (what, value) in dims.items():
                if axis < len(shape) and isinstance(shape[axis], int) and shape[axis] != value:
                    raise ModelFileError(f"the manifest says {what} = {value}, but the layer graph's "
                                         f"{name} has {shape[axis]} there (dims {shape})")

    @property
    def layout(self) -> Layout:
        """What this range's KV is (the KV store's entries are kept per layout)."""
        m = self.manifest
        return Layout(m.fingerprint, self.first, self.last, m.num_kv_heads, self.row, self.kv_dtype)

    @property
    def max_chunk(self) -> int:
        return self.chunks[-1]

    def padded(self, n: int) -> int:
        """The shape a step of n new tokens runs at: 1 for decode, else the next chunk size."""
        if n == 1:
            return 1
        if n > self.max_chunk:
            raise EdgeliteError(f"a step of {n} tokens is longer than the largest prompt chunk "
                                f"({self.max_chunk}); send the prompt in chunks")
        return self.chunks[bisect.bisect_left(self.chunks, n)]

    # ---- running ------------------------------------------------------------------------
    def _binding(self, slab: Slab, lo: int, hi: int, chunk: int) -> Binding:
        key = (id(slab), lo, hi, chunk)
        b = self.bindings.get(key)
        if b is not None:
            return b
        rows, h = hi - lo, self.manifest.hidden_size
        # the hidden states between sessions: session i reads buffers[i], writes buffers[i + 1]
        buffers = [np.zeros((rows, chunk, h), np.float32) for _ in range(len(self.sessions) + 1)]
        b = Binding([s.io_binding() for s in self.sessions], buffers[0], np.zeros(rows, np.int32),
                    np.zeros((), np.int32), buffers[-1], buffers[1:-1])
        b.runs = list(zip(self.sessions, b.io, strict=True))
        f32, i32, kv = np.float32, np.int32, self.pool.dtype
        for i, ((first, last), io) in enumerate(zip(self.groups, b.io, strict=True)):
            names = {x.name for x in self.sessions[i].get_inputs()}
            for name, arr, dtype in ((f"hidden_{first}", buffers[i], f32), ("seqlens_k", b.seqlens, i32),
                                     ("total_seq", b.total, i32),
                                     *((name, table, f32) for name, table in self.ropes.items()
                                       if name in names)):
                io.bind_input(name, "cpu", 0, dtype, list(arr.shape), arr.ctypes.data)
            for j in range(first, last + 1):
                k, v = slab.views(j - self.first, lo, hi)
                for kind, arr in (("key", k), ("value", v)):
                    io.bind_input(f"past_{kind}_{j}", "cpu", 0, kv, list(arr.shape), arr.ctypes.data)
                    io.bind_output(f"present_{kind}_{j}", "cpu", 0, kv, list(arr.shape), arr.ctypes.data)
            out = buffers[i + 1]
            io.bind_output(f"hidden_{last + 1}", "cpu", 0, f32, list(out.shape), out.ctypes.data)
        self.bindings[key] = b
        return b

    def _run(self, b: Binding) -> None:
        rows = b.hidden.shape[0] * b.hidden.shape[1]
        t0 = time.perf_counter()
        run_guarded(b.runs, self.run_options, self.clock.deadline(rows), f"layers {self.first}-{self.last}")
        self.clock.record(rows, time.perf_counter() - t0)

    def run(self, slot: Slot, hidden: np.ndarray) -> np.ndarray:
        """Append hidden (1, n, hidden_size) to the session in `slot`; the range's output for
        those n positions."""
        n = hidden.shape[1]
        chunk = self.padded(n)
        start = slot.length
        self._room(start + n)
        b = self._binding(slot.slab, slot.index, slot.index + 1, chunk)
        b.hidden[0, :n] = hidden[0]
        if chunk > n:
            b.hidden[0, n:] = 0.0
        b.seqlens[0] = start + chunk - 1
        b.total[...] = start + chunk
        self._run(b)
        slot.length = start + n
        if self.pool.windows:
            self.pool.expire(slot)
        return b.out[:, :n].copy()

    def _room(self, length: int) -> None:
        """Refuse a session of more positions than this range holds."""
        if length > self.pool.max_length:
            raise KVBudgetExceeded(f"the session would hold {length} positions; this range "
                                   f"holds at most {self.pool.max_length}")

    def decode_bytes(self, slot: Slot, hidden: memoryview) -> memoryview:
        """A decode step from and to raw bytes (float32, hidden_size of them): the output,
        a view of the binding's buffer valid until this range's next run. The node's decode
        lane: the same run as step(slot, one token), with the fewest Python calls."""
        start = slot.length
        self._room(start + 1)
        b = self.bindings.get((id(slot.slab), slot.index, slot.index + 1, 1))
        if b is None:
            b = self._binding(slot.slab, slot.index, slot.index + 1, 1)
        b.hidden_bytes[:] = hidden
        b.seqlens_mv[0] = start
        b.total_mv[0] = start + 1
        self._run(b)
        slot.length = start + 1
        if self.pool.windows:
            self.pool.expire(slot)
        return b.out_bytes

    def run_batch(self, slots: list[Slot], hidden: np.ndarray) -> np.ndarray:
        """One decode token for each session (all in one slab): hidden (len(slots), 1, hidden)
        -> the same. Slots between them that are not stepping get a dummy token written past
        their real length (it is overwritten by their next step)."""
        if not self.batchable:
            raise EdgeliteError("this range runs decode steps one session at a time (invariant, and "
                                "onnxruntime's attention or products would compute a batch's rows otherwise)")
        slab = slots[0].slab
        if any(s.slab is not slab for s in slots) or len({s.index for s in slots}) != len(slots):
            raise EdgeliteError("a batch must hold distinct slots of one slab")
        if any(s.length + 1 > self.pool.max_length for s in slots):
            raise KVBudgetExceeded(f"a session would exceed {self.pool.max_length} positions")
        lo, hi = min(s.index for s in slots), max(s.index for s in slots) + 1
        b = self._binding(slab, lo, hi, 1)
        b.hidden[...] = 0.0
        for r in range(lo, hi):
            other = slab.slots[r]
            b.seqlens[r - lo] = other.length if other is not None else 0
        for i, s in enumerate(slots):
            b.hidden[s.index - lo, 0] = hidden[i, 0]
        b.total[...] = int(b.seqlens.max()) + 1
        self._run(b)
        out = np.stack([b.out[s.index - lo] for s in slots])
        for s in slots:
            s.length += 1
            if self.pool.windows:
                self.pool.expire(s)
        return out

    def close(self) -> None:
        """Let go of the sessions and the KV; their memory goes back to the system."""
        self.bindings.clear()
        self.sessions.clear()
        self.pool.close()
        gc.collect()  # (onnxruntime's sessions may sit in reference cycles)
        heap.trim()


def groups(entries: list[FileEntry], first: int, limit: int) -> list[tuple[int, int]]:
    """Consecutive layers (first, last) per session: as many as hold at most `limit` bytes of
    weights together (a larger layer alone)."""
    out: list[tuple[int, int]] = []
    total = 0
    for j, e in enumerate(entries, first):
        size = sum(d.bytes for d in e.data)
        if out and total + size <= limit:
            out[-1] = (out[-1][0], j)
            total += size
        else:
            out.append((j, j))
            total = size
    return out
