"""Preallocated KV caches: one slot per session, in slabs of a few slots per layer range.

Every layer's keys and values of a slab are one buffer (slots, kv_heads, capacity, head_dim),
bound to the attention as both its past and present input: each step writes its new
positions in place and attention reads only the session's real length. The buffers hold
`RuntimeConfig.kv_dtype` (float32, or float16 at half the memory a position; "auto" is
float16 for a fast-mode export's invariant ranges, else float32: `Manifest.kv_dtype`). A batch of
decode steps binds the slots it covers, so sessions of different lengths run together without
copying.

The memory is reserved, not committed: pages are touched as positions are written, and a
session's pages go back to the operating system when it ends (madvise), so a process holds what
its sessions use, whatever the prompts were before. Sessions are accounted by capacity bucket:
the smallest configured capacity that covers their length (what they may come to hold).
"""

from __future__ import annotations

import bisect
import math
import mmap
from dataclasses import dataclass, field

import numpy as np

from edgelite.config import MAX_ROLLBACK
from edgelite.errors import EdgeliteError, KVBudgetExceeded

PAGE = mmap.PAGESIZE
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux and Android (x86 and ARM)
KV_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8}
RELEASE_POSITIONS = 64  # a windowed layer gives expired positions back this many at a time


@dataclass
class Slot:
    slab: Slab
    index: int
    length: int = 0  # positions holding valid KV
    released: int = 0  # leading positions whose pages windowed layers gave back (pool.expire)


@dataclass
class Slab:
    """`slots` sessions' KV for every layer of a range: (layers, 2, slots, kv_heads, cap, dim)."""

    buffer: mmap.mmap
    array: np.ndarray
    slots: list[Slot | None] = field(default_factory=list)

    def views(self, layer: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of slots lo..hi-1 of one layer: (hi - lo, kv_heads, cap, head_dim)."""
        return self.array[layer, 0, lo:hi], self.array[layer, 1, lo:hi]


class KVPool:
    """`windows`: per layer of the range, its attention window (0: full attention). A windowed
    layer's positions that no query can reach any more go back to the system as the session
    grows (`expire`), so its memory is bounded by the window, not the context; `slack` is how
    many positions beyond the window it may hold meanwhile (a step's new ones, the release
    granularity)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int,
                 slots_per_slab: int, buckets: tuple[int, ...], windows: tuple[int, ...] = (),
                 slack: int = 0, context: int = 0, dtype: str = "float32") -> None:
        if dtype not in KV_DTYPES:
            raise EdgeliteError(f"KV dtype {dtype!r}: one of {', '.join(KV_DTYPES)}")
        self.dtype = np.dtype(KV_DTYPES[dtype])
        row = kv_heads * head_dim * self.dtype.itemsize  # one position of one layer's K (or V)
        step = PAGE // math.gcd(PAGE, row)  # capacities whose slot regions start on a page
        self.capacity = -(-capacity // step) * step  # positions per slot (incl. padding room)
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.slots_per_slab = slots_per_slab
        self.buckets = tuple(sorted(buckets))
        self.slot_bytes = row * self.capacity  # one layer's K (or V) of one slot
        self.row = row
        self.windows = tuple(windows) if any(windows) else ()
        self.slack = slack + RELEASE_POSITIONS + MAX_ROLLBACK
        self.token_bytes = 2 * layers * row  # what one position costs across the range
        self.context = context or capacity  # the model's own context: no session holds more
        self.slabs: list[Slab] = []

    # ---- slots --------------------------------------------------------------------------
    def acquire(self) -> Slot:
        for slab in self.slabs:
            for i, s in enumerate(slab.slots):
                if s is None:
                    slab.slots[i] = Slot(slab, i)
                    return slab.slots[i]  # type: ignore[return-value]
        slab = self._new_slab()
        slab.slots[0] = Slot(slab, 0)
        return slab.slots[0]  # type: ignore[return-value]

    def _new_slab(self) -> Slab:
        n = self.slots_per_slab
        size = self.layers * 2 * n * self.slot_bytes
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        array = np.frombuffer(buf, self.dtype).reshape(
            self.layers, 2, n, self.kv_heads, self.capacity, self.head_dim)
        slab = Slab(buf, array, [None] * n)
        self.slabs.append(slab)
        return slab

    def release(self, slot: Slot) -> None:
        """Free a session's slot: its pages go back to the system (they read as zeros later)."""
        slab = slot.slab
        if slab.slots[slot.index] is not slot:
            return
        slab.slots[slot.index] = None
        for region in range(self.layers * 2):  # (untouched pages cost the kernel nothing)
            start = (region * self.slots_per_slab + slot.index) * self.slot_bytes
            slab.buffer.madvise(mmap.MADV_DONTNEED, start, self.slot_bytes)
        slot.length = slot.released = 0

    def expire(self, slot: Slot) -> None:
        """Give back the pages of windowed layers' positions that no later query reaches (those
        before length - window, less the positions a rollback may take back),
        RELEASE_POSITIONS or more at a time."""
        if not self.windows:
            return
        narrowest = min(w for w in self.windows if w) + MAX_ROLLBACK
        if slot.length - narrowest < slot.released + RELEASE_POSITIONS:
            return
        item = self.dtype.itemsize
        head = self.capacity * self.head_dim * item  # one head's positions, contiguous
        for layer, window in enumerate(self.windows):
            if not window:
                continue
            upto = max(0, slot.length - window - MAX_ROLLBACK)
            for kv in range(2):
                base = ((layer * 2 + kv) * self.slots_per_slab + slot.index) * self.slot_bytes
                for h in range(self.kv_heads):
                    a = base + h * head
                    start = -(-a // PAGE) * PAGE
                    end = (a + upto * self.head_dim * item) // PAGE * PAGE
                    if end > start:
                        slot.slab.buffer.madvise(mmap.MADV_DONTNEED, start, end - start)
        slot.released = slot.length - narrowest

    def swap(self, slot: Slot, index: int) -> None:
        """Move a session's KV to position `index` of its slab, and what held that position
        (another session's slot, or nothing) to its place: both keep their contents and
        lengths under each other's index (bindings, cached per position, stay valid)."""
        slab, i = slot.slab, slot.index
        other = slab.slots[index]
        n = max(slot.length, 0 if other is None else other.length)
        if n:
            mine = slab.array[:, :, i, :, :n].copy()
            slab.array[:, :, i, :, :n] = slab.array[:, :, index, :, :n]
            slab.array[:, :, index, :, :n] = mine
        slab.slots[i], slab.slots[index] = other, slot
        slot.index, slot.released = index, 0  # (the copies committed expired pages again)
        if other is not None:
            other.index, other.released = i, 0

    def rollback(self, slot: Slot, n: int) -> None:
        """The slot keeps its first n positions (at most MAX_ROLLBACK fewer than it holds):
        the next step writes from there, and attention reads only up to the new length."""
        if not slot.length - MAX_ROLLBACK <= n <= slot.length:
            raise EdgeliteError(f"the session holds {slot.length} positions; it may go back to "
                                   f"{max(0, slot.length - MAX_ROLLBACK)}-{slot.length}, not {n}")
        slot.length = n

    def read(self, slot: Slot, n: int) -> np.ndarray:
        """A copy of the slot's first n positions: (layers, 2, kv_heads, n, head_dim)."""
        if not 0 < n <= slot.length:
            raise KVBudgetExceeded(f"the session holds {slot.length} positions, not {n}")
        return slot.slab.array[:, :, slot.index, :, :n].copy()

    def view(self, slot: Slot) -> np.ndarray:
        """The slot's KV memory (layers, 2, kv_heads, max_length, head_dim), to fill in place
        (e.g. from the KV store) before the slot is given its length."""
        return slot.slab.array[:, :, slot.index, :, :self.max_length]

    def close(self) -> None:
        self.slabs.clear()  # the buffers go with their arrays

    # ---- accounting ---------------------------------------------------------------------
    @property
    def max_length(self) -> int:
        """The longest session this pool holds (the largest bucket, within the capacity)."""
        return min(self.buckets[-1], self.capacity, self.context)

    def bucket(self, length: int) -> int:
        """The capacity a session of `length` positions is accounted at."""
        if length > self.max_length:
            raise KVBudgetExceeded(f"a session of {length} positions exceeds the longest context "
                                   f"this node holds, {self.max_length}")
        return self.buckets[bisect.bisect_left(self.buckets, length)]

    def bucket_bytes(self, length: int) -> int:
        """The memory a session of `length` positions is accounted at: its bucket's positions
        in every layer, a windowed layer's capped at its window and slack."""
        bucket = self.bucket(max(1, length))
        if not self.windows:
            return bucket * self.token_bytes
        return sum(2 * self.row * (min(bucket, w + self.slack) if w else bucket) for w in self.windows)

    @property
    def sessions(self) -> int:
        return sum(1 for slab in self.slabs for s in slab.slots if s is not None)
