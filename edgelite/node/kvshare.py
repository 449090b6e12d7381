"""KV of layers that moved between nodes: a conversation continues on a plan that split the
model otherwise, and each stage takes its layers' KV from the entries of the plan that held
them before, instead of computing the history again.

A stage asked to restore a session with `sources` (KvRestore.sources: the old plan's stages
that held its layers) plans an import: from each source the layers it held of this stage's
range, out of this node's own KV store (a wider or other range stored here) or from the node
that held them, which reads and checks its entry and keeps those layers for it (kv_export),
to be fetched in chunks (kv_export_read). The session starts from the prefix every source
holds; the layers are copied into its reserved slot, which becomes the session's only when
every source delivered them (the same two-part restore as from the node's own entries).
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, replace

import numpy as np

from edgelite.config import NodeConfig, WireLimits
from edgelite.engine.kvfile import Layout, layout_from_json
from edgelite.engine.kvstore import KVStore, to_end
from edgelite.errors import EdgeliteError, ProtocolError
from edgelite.ids import NodeAddr
from edgelite.net import messages as m
from edgelite.net.link import NodeLink

log = logging.getLogger(__name__)


def kv_tokens(raw: bytes, what: str) -> np.ndarray:
    """Token ids sent as int32 little-endian bytes."""
    if len(raw) % 4:
        raise ProtocolError(f"{what}.tokens: {len(raw)} bytes is not a whole number of int32 ids")
    return np.frombuffer(raw, "<i4")


def export_bytes(layout: Layout, layers: int, positions: int) -> int:
    """The bytes of `layers` layers' KV of `positions` positions, as an export carries them
    (the layout's dtype)."""
    return layout.item.itemsize * layers * 2 * layout.kv_heads * positions * layout.head_dim


# ---- the node that held the layers --------------------------------------------------------
@dataclass
class Export:
    data: memoryview  # the layout's dtype (layers, 2, kv_heads, length, head_dim), as bytes
    deadline: float  # monotonic time after which it is dropped
    owner: str  # the connection (peer) it is for: dropped when that is gone


class Exports:
    """Layers of this node's stored KV read and kept for other nodes, fetched in chunks
    (dropped when read to the end, when the peer's connection ends, or after a while)."""

    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.held: dict[str, Export] = {}
        self.served = 0  # exports read to their end
        self.opening: list[int] = []  # bytes of each export being read (counted against the bounds)

    def _reap(self) -> None:
        now = time.monotonic()
        for handle in [h for h, e in self.held.items() if e.deadline < now]:
            del self.held[handle]
            log.info("kv export %s not fetched within %g s (kv_export_ttl_s); dropped",
                     handle[:8], self.cfg.kv_export_ttl_s)

    async def open(self, store: KVStore | None, msg: m.KvExport, owner: str) -> m.KvExportReady:
        try:
            layout = layout_from_json(msg.layout)
        except ValueError as exc:
            raise ProtocolError(f"kv_export.layout: {exc}") from None
        if not layout.first <= msg.first <= msg.last <= layout.last:
            raise ProtocolError(f"kv_export: layers {msg.first}-{msg.last} are not within the "
                                f"entry's {layout.first}-{layout.last}")
        tokens = kv_tokens(msg.tokens, "kv_export")
        self._reap()
        c = self.cfg
        if len(self.held) + len(self.opening) >= c.max_kv_exports:
            raise ProtocolError(f"kv_export: {len(self.held) + len(self.opening)} exports are held "
                                f"for other nodes (max_kv_exports); try later")
        if store is None or len(tokens) < store.block:
            return m.KvExportReady(id=msg.id, length=0, size=0)
        count = msg.last - msg.first + 1
        most = export_bytes(layout, count, len(tokens))
        # requests run side by side: what is being read counts against the bounds before the
        # read (at most `most` bytes: all of the tokens), not after it
        self.opening.append(most)
        try:
            used = sum(len(e.data) for e in self.held.values()) + sum(self.opening) - most
            n = await to_end(lambda: store.longest(layout, tokens))
            size = export_bytes(layout, count, n)
            if used + size > c.max_kv_export_bytes:
                raise ProtocolError(f"kv_export: {size} bytes would exceed the "
                                    f"{c.max_kv_export_bytes} this node holds for other nodes "
                                    f"(max_kv_export_bytes); try later")
            if not n:
                return m.KvExportReady(id=msg.id, length=0, size=0)
            into = np.empty((count, 2, layout.kv_heads, n, layout.head_dim), layout.item)
            lo = msg.first - layout.first
            hit = await to_end(lambda: store.get(layout, tokens[:n], into=into,
                                                 layers=range(lo, lo + count)))
            if hit is None:
                return m.KvExportReady(id=msg.id, length=0, size=0)
            data = memoryview(np.ascontiguousarray(hit.kv)).cast("B")
            handle = secrets.token_hex(16)
            self.held[handle] = Export(data, time.monotonic() + c.kv_export_ttl_s, owner)
            return m.KvExportReady(id=msg.id, length=hit.length, size=len(data), handle=handle)
        finally:
            self.opening.remove(most)

    def read(self, msg: m.KvExportRead, owner: str) -> m.KvExportData:
        e = self.held.get(msg.handle)
        if e is None or e.owner != owner:
            raise ProtocolError("kv_export_read: no such export here (fetched already, or "
                                "dropped after kv_export_ttl_s)")
        if msg.offset >= len(e.data):
            raise ProtocolError(f"kv_export_read: offset {msg.offset} is beyond the export's "
                                f"{len(e.data)} bytes")
        end = min(len(e.data), msg.offset + self.cfg.kv_export_chunk_bytes)
        chunk = bytes(e.data[msg.offset:end])
        if end == len(e.data):
            del self.held[msg.handle]
            self.served += 1
        return m.KvExportData(id=msg.id, data=chunk)

    def drop(self, owner: str) -> None:
        for handle in [h for h, e in self.held.items() if e.owner == owner]:
            del self.held[handle]

    def stats(self) -> dict:
        self._reap()
        return {"held": len(self.held), "bytes": sum(len(e.data) for e in self.held.values()),
                "served": self.served}


# ---- the node that takes the layers over --------------------------------------------------
@dataclass
class Piece:
    """Layers of a stage's range from one source: layers offset..offset+count-1 of the stage,
    stored under `layout` (the source's range) at index `within` of it, on the node at `addr`
    (None: this node's own store)."""

    layout: Layout
    addr: NodeAddr | None
    offset: int
    within: int
    count: int
    length: int = 0  # positions the source holds (0: none)
    link: NodeLink | None = None  # open to the source node while the import needs it
    handle: str = ""
    size: int = 0


def pieces(stage: Layout, sources: list[m.KvSource]) -> list[Piece]:
    """Where each of the stage's layers comes from; ProtocolError unless the sources cover
    every layer of the stage exactly once."""
    out, want = [], stage.first
    for s in sorted(sources, key=lambda s: s.first):
        if s.first > s.last:
            raise ProtocolError(f"kv_restore.sources: layers {s.first}-{s.last}")
        lo, hi = max(s.first, stage.first), min(s.last, stage.last)
        if lo > hi:
            continue
        if lo != want:
            break
        out.append(Piece(replace(stage, first=s.first, last=s.last), s.addr, lo - stage.first,
                         lo - s.first, hi - lo + 1))
        want = hi + 1
    if want != stage.last + 1:
        raise ProtocolError(f"kv_restore.sources do not cover layers {stage.first}-{stage.last} "
                            f"once each")
    return out


@dataclass
class Import:
    """A planned import (`plan`): its pieces and the prefix they all hold."""

    pieces: list[Piece]
    length: int

    async def close(self) -> None:
        for p in self.pieces:
            if p.link is not None:
                await p.link.close()
                p.link = None


async def plan(store: KVStore | None, stage: Layout, tokens: np.ndarray, sources: list[m.KvSource],
               token: str, limits: WireLimits, cfg: NodeConfig) -> Import:
    """Ask every source for the longest prefix of `tokens` it holds (a source node reads its
    entry and keeps the layers asked for); length 0 when one holds nothing or cannot be asked
    (logged: the session is then computed)."""
    imp = Import(pieces(stage, sources), 0)
    try:
        for p in imp.pieces:
            if p.addr is None:
                if store is not None and len(tokens) >= store.block:
                    p.length = await to_end(lambda lay=p.layout: store.longest(lay, tokens))
            else:
                p.link = await NodeLink.open(p.addr, token, stage.fingerprint, limits,
                                             cfg.kv_fetch_timeout_s)
                ready = await p.link.request(
                    m.KvExport(id=0, layout=p.layout.to_json(),
                               tokens=tokens.astype("<i4").tobytes(),
                               first=p.layout.first + p.within,
                               last=p.layout.first + p.within + p.count - 1),
                    m.KvExportReady, cfg.kv_fetch_timeout_s)
                if ready.length > len(tokens):  # (a prefix of the tokens asked about, no longer:
                    # what it claims is what would be allocated)
                    raise ProtocolError(f"node {p.addr} claims {ready.length} positions of a "
                                        f"{len(tokens)}-token prefix")
                p.length, p.handle, p.size = ready.length, ready.handle, ready.size
                if p.length and p.size != export_bytes(stage, p.count, ready.length):
                    raise ProtocolError(f"node {p.addr} offers {p.size} bytes for {ready.length} "
                                        f"positions of {p.count} layers")
            if not p.length:
                break
        imp.length = min(p.length for p in imp.pieces)
    except (EdgeliteError, OSError) as exc:
        log.info("the KV of layers %d-%d cannot be taken from the plan that held them: %s",
                 stage.first, stage.last, exc)
        imp.length = 0
    if not imp.length:
        await imp.close()
    return imp


async def fill(store: KVStore | None, imp: Import, tokens: np.ndarray, into: np.ndarray,
               timeout_s: float) -> int:
    """Copy every piece's first len(tokens) positions into `into` (the stage's slot:
    (layers, 2, kv_heads, >= len(tokens), head_dim)): len(tokens), or 0 (logged) when one
    cannot be had."""
    n = len(tokens)
    try:
        for p in imp.pieces:
            part = into[p.offset:p.offset + p.count]
            if p.addr is None:
                assert store is not None
                hit = await to_end(lambda p=p, part=part: store.get(
                    p.layout, tokens, into=part, layers=range(p.within, p.within + p.count)))
                if hit is None or hit.length != n:
                    raise EdgeliteError(f"the stored KV of layers {p.layout.first}-"
                                        f"{p.layout.last} is no longer usable")
                continue
            raw = await _fetch(p, timeout_s)
            await to_end(lambda p=p, part=part, raw=raw: _copy_in(p, raw, part, n))
    except (EdgeliteError, OSError) as exc:
        first = imp.pieces[0].layout.first + imp.pieces[0].within
        log.warning("the KV of layers %d-%d was not taken over: %s", first,
                    first + into.shape[0] - 1, exc)
        return 0
    finally:
        await imp.close()
    return n


async def _fetch(p: Piece, timeout_s: float) -> np.ndarray:
    assert p.link is not None
    buf = np.empty(p.size, np.uint8)
    got = 0
    while got < p.size:
        chunk = await p.link.request(m.KvExportRead(id=0, handle=p.handle, offset=got),
                                     m.KvExportData, timeout_s)
        if not chunk.data or got + len(chunk.data) > p.size:
            raise ProtocolError(f"node {p.link.addr} sent {len(chunk.data)} bytes of KV at "
                                f"offset {got} of {p.size}")
        buf[got:got + len(chunk.data)] = np.frombuffer(chunk.data, np.uint8)
        got += len(chunk.data)
    return buf


def _copy_in(p: Piece, raw: np.ndarray, part: np.ndarray, n: int) -> None:
    kv = raw.view(p.layout.item).reshape(p.count, 2, part.shape[2], p.length, part.shape[4])[:, :, :, :n]
    if not np.isfinite(kv).all():
        raise ProtocolError("a node sent KV holding non-finite values")
    part[:, :, :, :n] = kv
