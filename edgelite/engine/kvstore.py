"""A persistent store of sessions' KV for one device's layer range, keyed by token prefix.

An entry holds the KV of a range's layers for the first n tokens of a token sequence. It is
found by a chained sha256 over fixed-size token blocks, seeded with the model fingerprint, the
layer range and the KV layout: h_0 = sha256(seed), h_i = sha256(h_{i-1} + block i). The index
(sqlite, WAL) maps each block hash of an entry to it, so any prefix of a stored sequence is
found, not only the whole: the longest stored prefix of a prompt is the deepest of its block
hashes that the index knows, extended token by token within that entry. The entry's token ids
are stored and compared on every hit: a hash collision can never return wrong KV.

Payloads are plain files named by a hash of seed and tokens (their format, and the atomic
write that leaves no half-written entry: engine/kvfile.py). Saves can be written behind
(`put_later`: one writer thread, the caller's copy kept until written), so a finished request
does not wait for the disk; lookups wait for the writes queued before them. A read checks everything
before anything uses the KV (it goes straight into a new session's slot, which becomes the
session's only when the whole entry passed); an entry that fails any check is a miss with one
log line, and is deleted. The index can always be rebuilt from the files (it is, when it is missing
or unreadable); files the index does not know are indexed at start, rows without files dropped.
A disk budget evicts the least recently used entries; an entry a newer one extends is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from edgelite.config import KVStoreConfig
from edgelite.engine.kvfile import (
    SUFFIX,
    CorruptEntry,
    Layout,
    check_kv,
    encode,
    read_entry,
    read_header,
    write_atomic,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


def block_hashes(layout: Layout, tokens: np.ndarray, block: int) -> list[str]:
    """The chained hash after each whole block of `tokens` (int32)."""
    h = layout.seed
    out = []
    raw = np.ascontiguousarray(tokens, np.int32).tobytes()
    for i in range(len(tokens) // block):
        h = hashlib.sha256(h + raw[4 * block * i:4 * block * (i + 1)]).digest()
        out.append(h.hex())
    return out


@dataclass(frozen=True)
class Hit:
    length: int  # tokens whose KV `kv` holds (a prefix of the query)
    kv: np.ndarray  # (layers, 2, kv_heads, length, head_dim) of the layout's dtype (a view of get's `into`)


class KVStore:
    """Entries in `root` within `budget_bytes`; blocks of `block` tokens. Thread-safe.

    Saves can be written behind (`put_later`): one writer thread, `writer_nice` below normal
    priority (a write yields the CPU to steps), at most `max_pending_bytes` of copies waiting;
    lookups wait for the writes queued before them."""

    def __init__(self, root: Path, budget_bytes: int, block: int = 16,
                 max_pending_bytes: int = 64 << 20, writer_nice: int = 10) -> None:
        self.root, self.budget, self.block = Path(root), budget_bytes, block
        self.max_pending_bytes = max_pending_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, "kv-write", _lower_priority, (writer_nice,))
        self._writes = threading.Condition()
        self._queued = self._written = 0  # writes queued, and written (or failed), so far
        self._pending_bytes = 0
        self.hits = self.misses = self.corrupt = self.saved = self.evicted = 0
        self.db = self._open_index()
        self._reconcile()

    # ---- the index -----------------------------------------------------------------------
    def _open_index(self) -> sqlite3.Connection:
        path = self.root / "index.sqlite"
        for attempt in range(2):
            try:
                db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("CREATE TABLE IF NOT EXISTS entries (name TEXT PRIMARY KEY, "
                           "seed TEXT, n INTEGER, tokens BLOB, bytes INTEGER, last_use REAL)")
                db.execute("CREATE TABLE IF NOT EXISTS blocks (hash TEXT, name TEXT, "
                           "depth INTEGER, PRIMARY KEY (hash, name))")
                db.execute("SELECT count(*) FROM entries").fetchone()
                return db
            except sqlite3.DatabaseError as exc:
                if attempt:
                    raise
                log.warning("KV store index %s is unreadable (%s); rebuilding it from the "
                            "entry files", path, exc)
                for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
                    p.unlink(missing_ok=True)
        raise AssertionError("unreachable")

    def _reconcile(self) -> None:
        """Index every entry file, forget rows without one, remove killed writers' leftovers."""
        for tmp in self.root.glob(".tmp-*"):
            tmp.unlink(missing_ok=True)
        files = {p.name[:-len(SUFFIX)]: p for p in self.root.glob("*" + SUFFIX)}
        with self.lock:
            known = {name for (name,) in self.db.execute("SELECT name FROM entries")}
            for name in known - files.keys():
                self._forget(name)
        for name in files.keys() - known:
            try:
                layout, tokens = read_header(files[name])
            except (OSError, CorruptEntry) as exc:
                log.warning("KV store: %s is not a valid entry (%s); removed", files[name].name, exc)
                files[name].unlink(missing_ok=True)
                continue
            try:
                with self.lock:
                    self._index(name, layout, tokens, files[name].stat().st_size)
            except (OSError, ValueError, TypeError, OverflowError) as exc:  # (a crafted file: a miss)
                log.warning("KV store: %s could not be indexed (%s); removed", files[name].name, exc)
                files[name].unlink(missing_ok=True)

    def _index(self, name: str, layout: Layout, tokens: np.ndarray, nbytes: int) -> None:
        hashes = block_hashes(layout, tokens, self.block)
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?)",
                            (name, layout.seed.hex(), len(tokens), tokens.astype(np.int32).tobytes(),
                             nbytes, time.time()))
            self.db.executemany("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?)",
                                [(h, name, i + 1) for i, h in enumerate(hashes)])

    def _forget(self, name: str) -> None:
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("DELETE FROM entries WHERE name = ?", (name,))
            self.db.execute("DELETE FROM blocks WHERE name = ?", (name,))

    def _drop(self, name: str) -> None:
        self._forget(name)
        (self.root / (name + SUFFIX)).unlink(missing_ok=True)

    def _used(self) -> int:
        return int(self.db.execute("SELECT coalesce(sum(bytes), 0) FROM entries").fetchone()[0])

    @property
    def bytes_used(self) -> int:
        with self.lock:
            return self._used()

    @property
    def entries(self) -> int:
        with self.lock:
            return int(self.db.execute("SELECT count(*) FROM entries").fetchone()[0])

    # ---- lookups -------------------------------------------------------------------------
    def _candidates(self, layout: Layout, tokens: np.ndarray) -> list[tuple[str, int, int]]:
        """Entries sharing at least one block with `tokens`: (name, tokens shared, tokens
        held), most shared first (token ids compared, not only hashes)."""
        hashes = block_hashes(layout, tokens, self.block)
        if not hashes:
            return []
        out = []
        with self.lock:
            rows = self.db.execute(
                f"SELECT e.name, e.tokens FROM blocks b JOIN entries e ON e.name = b.name "
                f"WHERE e.seed = ? AND b.hash IN ({','.join('?' * len(hashes))}) "
                f"GROUP BY e.name", (layout.seed.hex(), *hashes)).fetchall()
        for name, raw in rows:
            stored = np.frombuffer(raw, np.int32)
            n = min(len(stored), len(tokens))
            diff = np.flatnonzero(stored[:n] != tokens[:n])
            out.append((name, int(diff[0]) if diff.size else n, len(stored)))
        return sorted(out, key=lambda c: -c[1])

    def longest(self, layout: Layout, tokens: np.ndarray, at_most: int | None = None) -> int:
        """The length of the longest stored prefix of `tokens` (at most `at_most`; 0 when it
        is shorter than a block), from the index alone: what `get` returns unless the entry
        fails its checks when read."""
        self._written_up_to_now()
        found = self._candidates(layout, np.asarray(tokens, np.int32)[:at_most])
        return found[0][1] if found and found[0][1] >= self.block else 0

    def get(self, layout: Layout, tokens: np.ndarray, at_most: int | None = None,
            into: np.ndarray | None = None, layers: range | None = None) -> Hit | None:
        """The KV of the longest stored prefix of `tokens` (at most `at_most` tokens), checked
        completely; None when nothing usable is stored. `into`: where it goes (see
        read_entry; at most as many positions as it holds); the hit's KV is a view of it.
        `layers`: only these of the layout's layers (indices within it) are copied out."""
        self._written_up_to_now()
        tokens = np.asarray(tokens, np.int32)
        if into is not None:
            at_most = min(into.shape[3], at_most if at_most is not None else len(tokens))
        if at_most is not None:
            tokens = tokens[:at_most]
        for name, length, _ in self._candidates(layout, tokens):
            if length < self.block:
                break
            path = self.root / (name + SUFFIX)
            try:
                kv = read_entry(path, layout, tokens[:length], into, layers)
            except (OSError, CorruptEntry) as exc:
                log.warning("KV store: entry %s is unusable (%s); dropped, recomputing instead",
                            name[:16], exc)
                with self.lock:
                    self.corrupt += 1
                    self._drop(name)
                continue
            with self.lock:
                self.hits += 1
                with self.db:
                    self.db.execute("UPDATE entries SET last_use = ? WHERE name = ?", (time.time(), name))
            return Hit(length, kv)
        with self.lock:
            self.misses += 1
        return None

    # ---- writing -------------------------------------------------------------------------
    def put(self, layout: Layout, tokens: np.ndarray, kv: np.ndarray) -> int:
        """Store the KV (layers, 2, kv_heads, n, head_dim) of `tokens` (n); entries it extends
        are dropped, then the least recently used until the budget holds. Returns its bytes
        (0 when it was not kept: shorter than a block, or larger than the whole budget)."""
        tokens = np.ascontiguousarray(tokens, np.int32)
        n = len(tokens)
        check_kv(layout, n, kv)
        if n < self.block:
            return 0
        name = hashlib.sha256(layout.seed + tokens.tobytes()).hexdigest()
        header, payload = encode(layout, tokens, kv)
        size = len(header) + sum(len(p) for p in payload)
        if size > self.budget:
            log.info("KV store: an entry of %d bytes exceeds the whole budget (%d); not stored",
                     size, self.budget)
            return 0
        write_atomic(self.root / (name + SUFFIX), [header, *payload])
        extended = [c[0] for c in self._candidates(layout, tokens) if c[0] != name and c[1] == c[2]]
        with self.lock:
            for old in extended:  # older entries this one holds whole
                self._drop(old)
            self._index(name, layout, tokens, size)
            self.saved += 1
            self._evict(keep=name)
        return size

    def put_later(self, layout: Layout, tokens: np.ndarray, kv: np.ndarray) -> int:
        """`put` in the store's writer thread: returns once the write is queued, with the KV's
        bytes (0: fewer tokens than a block). `kv` must be the caller's own copy (it is kept
        until written). While `max_pending_bytes` of copies wait, this waits for earlier ones
        to be written. A write that fails is logged and its entry is a miss. A caller that
        saves a finished conversation does not wait for the disk (fsync) this way."""
        tokens = np.array(tokens, np.int32)
        check_kv(layout, len(tokens), kv)
        if len(tokens) < self.block:
            return 0
        with self._writes:
            while self._queued > self._written and self._pending_bytes + kv.nbytes > self.max_pending_bytes:
                self._writes.wait()
            self._queued += 1
            self._pending_bytes += kv.nbytes
        try:
            self._writer.submit(self._write, layout, tokens, kv)
        except RuntimeError:  # closed
            self._wrote(kv.nbytes)
            raise
        return kv.nbytes

    def _write(self, layout: Layout, tokens: np.ndarray, kv: np.ndarray) -> None:
        try:
            self.put(layout, tokens, kv)
        except (OSError, sqlite3.Error, ValueError) as exc:
            log.warning("KV store: an entry of %d tokens could not be written (%s); it will be "
                        "computed again when needed", len(tokens), exc)
        finally:
            self._wrote(kv.nbytes)

    def _wrote(self, nbytes: int) -> None:
        with self._writes:
            self._written += 1
            self._pending_bytes -= nbytes
            self._writes.notify_all()

    def _written_up_to_now(self) -> None:
        """Wait for the writes queued so far (writes run in order: a lookup finds what was
        saved before it)."""
        with self._writes:
            target = self._queued
            while self._written < target:
                self._writes.wait()

    def _evict(self, keep: str) -> None:
        used = self._used()
        for name, nbytes in self.db.execute(
                "SELECT name, bytes FROM entries WHERE name != ? ORDER BY last_use", (keep,)).fetchall():
            if used <= self.budget:
                break
            self._drop(name)
            self.evicted += 1
            used -= nbytes

    def stats(self) -> dict:
        with self.lock:
            n = self.db.execute("SELECT count(*) FROM entries").fetchone()[0]
            return {"entries": n, "bytes": self._used(), "budget_bytes": self.budget, "hits": self.hits,
                    "misses": self.misses, "corrupt": self.corrupt, "saved": self.saved,
                    "evicted": self.evicted}

    def close(self) -> None:
        """After the queued writes (blocks: off an event loop)."""
        self._writer.shutdown(wait=True)
        with self.lock:
            self.db.close()


def _lower_priority(nice: int) -> None:
    """Lower the calling thread's priority by `nice` (on Linux and Android, per thread)."""
    if nice > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except (OSError, AttributeError) as exc:  # (no setpriority here)
            log.info("the KV store's writer keeps its priority: %s", exc)


async def to_end(fn: Callable[[], T]) -> T:
    """fn() in a worker thread, awaited to its end even when the caller is cancelled (the
    cancellation is raised after it): for work that writes into memory the caller frees or
    hands on afterwards, so nothing may still be writing into it."""
    fut = asyncio.get_running_loop().run_in_executor(None, fn)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([fut])
        raise


async def read_off_thread(store: KVStore, layout: Layout, tokens: np.ndarray,
                          into: np.ndarray) -> Hit | None:
    """`store.get(layout, tokens, into=into)` in a worker thread, awaited to its end (to_end)."""
    return await to_end(lambda: store.get(layout, tokens, into=into))


async def hand_over(fill: Awaitable[int], attach: Callable[[int], Awaitable[int]],
                    abandon: Callable[[], Awaitable[None]]) -> int:
    """Await `fill`, which writes KV into memory reserved for it (a new session's slot) and
    gives the positions written (0: nothing usable); then `attach(length)` hands the memory
    over (its result is returned), or `abandon()` frees it when nothing was written or the
    fill failed."""
    n = 0
    try:
        n = await fill
    finally:
        if not n:
            await abandon()
    return await attach(n) if n else 0


async def restore_into(store: KVStore, layout: Layout, tokens: np.ndarray, into: np.ndarray,
                       exact: bool, attach: Callable[[int], Awaitable[int]],
                       abandon: Callable[[], Awaitable[None]]) -> int:
    """Fill `into`, memory reserved for it, with the KV of the longest stored prefix of
    `tokens` (of all of them when `exact`, else nothing), read and checked off the caller's
    thread; then attach it or abandon it (hand_over)."""
    async def read() -> int:
        hit = await read_off_thread(store, layout, tokens, into)
        return 0 if hit is None or (exact and hit.length != len(tokens)) else hit.length

    return await hand_over(read(), attach, abandon)


def open_store(cfg: KVStoreConfig, default_dir: Path) -> KVStore | None:
    """The store `cfg` asks for (None when it is off, or cannot be opened: then it says so)."""
    if not cfg.enabled:
        return None
    root = Path(cfg.dir) if cfg.dir else default_dir
    try:
        return KVStore(root, cfg.budget_bytes, cfg.block_tokens, cfg.max_pending_write_bytes,
                       cfg.writer_nice)
    except (OSError, sqlite3.Error) as exc:
        log.warning("KV store in %s cannot be opened (%s); conversations will be recomputed",
                    root, exc)
        return None
