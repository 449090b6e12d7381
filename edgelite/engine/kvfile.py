"""The KV store's entry files (engine/kvstore.py keeps them and their index): what an entry's
KV is (`Layout`), and the file's format: a header (magic, version, fingerprint, layer range,
layout, token count, each section's checksum) with its own sha256, then the token ids and the
KV. A write goes to a temporary file, is fsynced and renamed into place (`write_atomic`), so a
killed writer leaves no file that reads as an entry; a read (`read_entry`) checks everything
before anything uses the KV, and a file that fails a check raises CorruptEntry.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

MAGIC = b"EDGELKV\x00"
VERSION = 1
SUFFIX = ".kv"
_HEAD = struct.Struct("<8sII")  # magic, version, header length
MAX_HEADER = 1 << 16


class CorruptEntry(Exception):
    """An entry file that fails a check (read as a miss)."""


STORED = {"float32": "<f4", "float16": "<f2", "int8": "i1"}  # the KV dtypes a layout may have


@dataclass(frozen=True)
class Layout:
    """What an entry's KV is: whose layers, and how they are laid out. Entries of another
    layout (model, range, shape, dtype) are never returned."""

    fingerprint: str
    first: int
    last: int
    kv_heads: int
    head_dim: int  # the values a head's row holds (an int8 row: head_dim + its exponent)
    dtype: str = "float32"
    # whose entries these are (a node's clients each have their own: none finds, reads or
    # restores another's KV); "" for a store of one user's (the client's own)
    domain: str = ""

    @property
    def layers(self) -> int:
        return self.last - self.first + 1

    @property
    def item(self) -> np.dtype:
        """The KV's numpy dtype, little-endian (as stored and sent)."""
        return np.dtype(STORED[self.dtype])

    def to_json(self) -> dict:
        out = {"fingerprint": self.fingerprint, "first": self.first, "last": self.last,
               "kv_heads": self.kv_heads, "head_dim": self.head_dim, "dtype": self.dtype}
        return out | {"domain": self.domain} if self.domain else out

    @functools.cached_property
    def seed(self) -> bytes:  # (hashed once: every lookup, index row and block hash uses it)
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).digest()

    def shape(self, n: int) -> tuple[int, ...]:
        return (self.layers, 2, self.kv_heads, n, self.head_dim)  # K and V of each layer


def layout_from_json(obj: object) -> Layout:
    """A Layout sent by a peer (kv_export), checked field by field; ValueError otherwise."""
    fields = {"fingerprint", "first", "last", "kv_heads", "head_dim", "dtype"}
    if not isinstance(obj, dict) or not fields <= set(obj) <= fields | {"domain"}:
        raise ValueError("a KV layout has the fields fingerprint, first, last, kv_heads, "
                         "head_dim, dtype (and domain)")
    fp, dtype, domain = obj["fingerprint"], obj["dtype"], obj.get("domain", "")
    if not isinstance(domain, str) or len(domain) > 64:
        raise ValueError("a KV layout's domain is a string of at most 64 characters")
    ints = [obj[k] for k in ("first", "last", "kv_heads", "head_dim")]
    if not isinstance(fp, str) or len(fp) > 128 or dtype not in STORED:
        raise ValueError(f"a KV layout's fingerprint is a string, its dtype one of {', '.join(STORED)}")
    if any(type(v) is not int or not 0 <= v < 1 << 16 for v in ints) or ints[0] > ints[1] \
            or not (ints[2] and ints[3]):
        raise ValueError(f"KV layout fields out of range: {ints}")
    return Layout(fp, *ints, dtype=dtype, domain=domain)


def check_kv(layout: Layout, n: int, kv: np.ndarray) -> None:
    if kv.shape != layout.shape(n) or kv.dtype != np.dtype(layout.dtype):
        raise ValueError(f"KV of shape {kv.shape} {kv.dtype} for {n} tokens; expected "
                         f"{layout.shape(n)} {layout.dtype}")


# ---- the file format -----------------------------------------------------------------------
def _digest(data: bytes | memoryview, kind: str) -> str:
    """A section's checksum: sha256 for the header and token ids; crc32 for the KV (2.5x
    faster, and it catches torn writes and flipped bits; the token ids, not the KV, decide
    what an entry is for)."""
    return hashlib.sha256(data).hexdigest() if kind == "sha256" else f"{zlib.crc32(data):08x}"


SECTIONS = ("sha256", "crc32")  # the checksum of each section: token ids, KV


def encode(layout: Layout, tokens: np.ndarray, kv: np.ndarray) -> tuple[bytes, list[bytes | memoryview]]:
    """(header bytes, payload sections) of an entry (the KV section is a view of `kv` when it
    is contiguous and of the layout's little-endian dtype already: no copy)."""
    sections: list[bytes | memoryview] = [tokens.astype("<i4").tobytes(),
                                          memoryview(np.ascontiguousarray(kv, layout.item)).cast("B")]
    meta = {"layout": layout.to_json(), "tokens": len(tokens),
            "sections": [[len(s), _digest(s, kind)] for s, kind in zip(sections, SECTIONS, strict=True)]}
    body = json.dumps(meta, sort_keys=True).encode()
    head = _HEAD.pack(MAGIC, VERSION, len(body)) + body
    return head + hashlib.sha256(head).digest(), sections


def _read_meta(f: BinaryIO) -> dict:
    fixed = f.read(_HEAD.size)
    if len(fixed) < _HEAD.size:
        raise CorruptEntry("truncated header")
    magic, version, length = _HEAD.unpack(fixed)
    if magic != MAGIC:
        raise CorruptEntry("not a KV entry (bad magic)")
    if version != VERSION:
        raise CorruptEntry(f"format version {version}, this build reads {VERSION}")
    if not 0 < length <= MAX_HEADER:
        raise CorruptEntry(f"header length {length}")
    body = f.read(length)
    digest = f.read(32)
    if len(body) < length or len(digest) < 32:
        raise CorruptEntry("truncated header")
    if hashlib.sha256(fixed + body).digest() != digest:
        raise CorruptEntry("header checksum mismatch")
    try:
        meta = json.loads(body)
        Layout(**meta["layout"])
        n, sections = int(meta["tokens"]), meta["sections"]
        if len(sections) != 2 or n < 0:
            raise ValueError("sections")
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptEntry(f"header fields: {exc}") from None
    return meta


def _section(f: BinaryIO, size: int, sha: str, what: str) -> bytes:
    data = f.read(size)
    if len(data) < size:
        raise CorruptEntry(f"truncated {what}")
    if _digest(data, "sha256") != sha:
        raise CorruptEntry(f"{what} checksum mismatch")
    return data


def read_header(path: Path) -> tuple[Layout, np.ndarray]:
    """An entry's layout and token ids (both checked)."""
    with open(path, "rb") as f:
        meta = _read_meta(f)
        try:  # (a crafted header may have any JSON here: every reading of it is a miss)
            (tsize, tsha), _ = meta["sections"]
            if type(tsize) is not int or tsize != 4 * meta["tokens"] or type(tsha) is not str:
                raise CorruptEntry("token section size")
            layout = layout_from_json(meta["layout"])
            _ = layout.seed  # (its fields must make a layout's hash)
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
            raise CorruptEntry(f"header fields: {exc}") from None
        return layout, np.frombuffer(_section(f, tsize, tsha, "token ids"), "<i4")


def read_entry(path: Path, layout: Layout, tokens: np.ndarray,
               into: np.ndarray | None = None, layers: range | None = None) -> np.ndarray:
    """The KV (layers, 2, kv_heads, len(tokens), head_dim) of the first len(tokens) positions
    of an entry, after checking that it is of `layout`, that its checksums hold and that it
    was stored for these very tokens. `layers`: only these of its layers (indices within the
    layout; by default all) are copied out (the checksum covers every one). `into`: where
    to put them, an array (layers, 2, kv_heads, >= len(tokens), head_dim), e.g. a new
    session's KV slot that nothing uses yet (after a failed check it holds garbage); by
    default a new array. The KV section is read one head's positions at a time through a
    small buffer that stays in cache while its checksum and finiteness are checked and its
    first len(tokens) positions are copied out: no scratch copy of the whole entry, one pass
    over it."""
    k = len(tokens)
    wanted = layers if layers is not None else range(layout.layers)
    if wanted.step != 1 or not 0 <= wanted.start < wanted.stop <= layout.layers:
        raise ValueError(f"layers {wanted} of an entry of {layout.layers}")
    shape = (len(wanted), *layout.shape(k)[1:])
    if into is None:
        into = np.empty(shape, layout.item)
    elif (into.dtype != layout.item or into.ndim != 5 or into.shape[:3] != shape[:3]
          or into.shape[3] < k or into.shape[4] != shape[4]):
        raise ValueError(f"KV of {list(shape)} does not fit an array of {list(into.shape)}")
    with open(path, "rb") as f:
        meta = _read_meta(f)
        if Layout(**meta["layout"]) != layout:
            raise CorruptEntry(f"stored for {meta['layout']}, not {layout.to_json()}")
        n = meta["tokens"]
        (tsize, tsha), (ksize, ksha) = meta["sections"]
        if tsize != 4 * n or ksize != layout.item.itemsize * int(np.prod(layout.shape(n))) or n < k:
            raise CorruptEntry("section sizes do not match the header")
        stored = np.frombuffer(_section(f, tsize, tsha, "token ids"), "<i4")
        if not np.array_equal(stored[:k], tokens):
            raise CorruptEntry("stored for other tokens")
        block = np.empty((n, layout.head_dim), layout.item)  # one head's positions as stored
        raw, crc = memoryview(block).cast("B"), 0
        for li in range(layout.layers):
            for kind in range(2):
                for head in range(layout.kv_heads):
                    if f.readinto(raw) != len(raw):
                        raise CorruptEntry("truncated KV section")
                    crc = zlib.crc32(raw, crc)
                    if li not in wanted:
                        continue
                    if not np.isfinite(block[:k]).all():
                        raise CorruptEntry("KV holds non-finite values")
                    into[li - wanted.start, kind, head, :k] = block[:k]
        if f.read(1):
            raise CorruptEntry("overlong KV section")
        if f"{crc:08x}" != ksha:
            raise CorruptEntry("KV checksum mismatch")
    return into[:, :, :, :k]


def write_atomic(path: Path, parts: list[bytes | memoryview]) -> None:
    """Write `parts` to `path` so that it either appears whole or not at all."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            for p in parts:
                f.write(p)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
