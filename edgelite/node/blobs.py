"""Content-addressed store for deployed model files: DIR/blobs/<sha256>.

Names from the wire are never used as paths: a blob is named only by a validated sha256.
Uploads append to <sha256>.part at the stated offset (so a broken transfer resumes where it
stopped) and become a blob only when the whole file hashes to its name. Uploads are bounded (a
declared size, a disk quota); partial uploads nobody finishes are deleted. A blob is checked
again before it is loaded (its hash is cached by size, mtime and inode, so an unchanged file is
not hashed twice; the change time is in the key too, which no one can set back); symbolic
links and other non-files are refused. A blob that no longer hashes to its name is deleted
and reported missing, so the next deploy uploads it again.

Blobs are a cache: one that no loaded plan uses (`pinned`) and no pushed model folder links to
is deleted when unused for a while (`collect`), and the least recently used of them make room
when an upload would pass the disk quota; a blob used within `grace_s` (a deploy under way)
is never deleted.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgelite.errors import ModelFileError, ProtocolError
from edgelite.manifest import sha256_file

log = logging.getLogger(__name__)
_SHA = re.compile(r"^[0-9a-f]{64}$")


def check_sha(value: object) -> str:
    if not isinstance(value, str) or not _SHA.fullmatch(value):
        raise ProtocolError(f"not a sha256 hex digest: {str(value)[:80]!r}")
    return value


def _key(st: os.stat_result) -> tuple[int, ...]:
    """What must stay the same for a checked blob not to be hashed again."""
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


@dataclass(frozen=True)
class BlobFigures:
    """What the store holds: every blob; those nothing uses and that were not used within the
    grace time (what `collect` deletes now); and those nothing uses but used within it (a
    deploy under way may want them: kept until the grace time has passed)."""

    files: int
    bytes: int
    unused_files: int
    unused_bytes: int
    recent_files: int = 0
    recent_bytes: int = 0


class BlobStore:
    def __init__(self, root: Path, max_file_bytes: int = 1 << 62, quota_bytes: int = 1 << 62,
                 part_ttl_s: float = 3600.0, grace_s: float = 3600.0) -> None:
        self.dir = root / "blobs"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_file_bytes, self.quota_bytes, self.part_ttl_s = max_file_bytes, quota_bytes, part_ttl_s
        self.grace_s = grace_s
        # the blobs in use (a loaded plan's files): never deleted; the node sets it
        self.pinned: Callable[[], set[str]] = set
        self._verified: dict[str, tuple[int, ...]] = {}  # sha -> (size, mtime, ctime, inode)
        self._used: dict[str, float] = {}  # sha -> when it was last used (wall clock)
        # uploads under way -> their declared sizes: the quota counts what they will hold
        self._declared: dict[str, int] = {}
        self._lock = threading.Lock()  # appends run in worker threads, side by side

    def path(self, sha: str) -> Path:
        return self.dir / check_sha(sha)

    def _regular(self, path: Path) -> os.stat_result | None:
        """The file's status when it is a regular file (not a link, not a folder), else None."""
        try:
            st = path.lstat()
        except OSError:
            return None
        return st if stat.S_ISREG(st.st_mode) else None

    def has(self, sha: str) -> bool:
        return self._regular(self.path(sha)) is not None

    def intact(self, sha: str) -> bool:
        """Whether the blob is here and hashes to its name (checked again only when its file
        changed); a damaged one is deleted, so that the next deploy uploads it again."""
        try:
            self.verified(sha, "blob")
        except ModelFileError:
            return False
        return True

    def partial(self, sha: str) -> int:
        st = self._regular(self.dir / f"{check_sha(sha)}.part")
        return st.st_size if st else 0

    def used_bytes(self) -> int:
        return sum(st.st_size for p in self.dir.iterdir() if (st := self._regular(p)) is not None)

    def append(self, sha: str, offset: int, total: int, data: bytes) -> int:
        """Write a chunk; returns bytes held. Completes (hash-checked) when `total` is reached.
        The disk quota counts every upload under way at its declared size."""
        with self._lock:
            return self._append(sha, offset, total, data)

    def _append(self, sha: str, offset: int, total: int, data: bytes) -> int:
        if self.has(sha):
            return total
        if total > self.max_file_bytes:
            raise ProtocolError(f"upload {sha[:12]}: {total} bytes declared; this node takes files "
                                f"of at most {self.max_file_bytes}")
        part = self.dir / f"{check_sha(sha)}.part"
        if part.is_symlink():
            raise ModelFileError(f"upload {sha[:12]}: {part.name} is a symbolic link; refused")
        held = self.partial(sha)
        if offset != held:
            raise ProtocolError(f"upload {sha[:12]}: chunk at offset {offset}, expected {held}")
        if held + len(data) > total:
            raise ProtocolError(f"upload {sha[:12]}: chunk runs past the stated size {total}")
        if self._declared.get(sha) != total:  # a new upload (or one resumed after a restart)
            coming = sum(max(0, t - self.partial(s)) for s, t in self._declared.items() if s != sha)
            over = self.used_bytes() - held + coming + total - self.quota_bytes
            if over > 0:  # unused blobs make room, the least recently used first
                self._collect(self.pinned() | {sha}, self.grace_s, over)
                over = self.used_bytes() - held + coming + total - self.quota_bytes
            if over > 0:
                raise ProtocolError(f"upload {sha[:12]}: {total} more bytes would exceed this "
                                    f"node's disk quota of {self.quota_bytes} (with the uploads "
                                    f"under way)")
            self._declared[sha] = total
        with open(part, "ab") as f:
            f.write(data)
            if held + len(data) == total:
                f.flush()
                os.fsync(f.fileno())
        held += len(data)
        if held == total:
            self._declared.pop(sha, None)
            if sha256_file(part) != sha:
                part.unlink()
                raise ModelFileError(f"upload {sha[:12]}: content does not hash to its name; "
                                     f"discarded")
            final = self.path(sha)
            part.rename(final)
            self._remember(sha, final)  # just hashed: the next load need not hash it again
        return held

    def verified(self, sha: str, what: str) -> Path:
        """The blob's path, after checking it is a regular file whose content hashes to its name
        (again only when its size, mtime or inode changed since the last check)."""
        path = self.path(sha)
        st = self._regular(path)
        if st is None:
            raise ModelFileError(f"{what} ({sha[:12]}) is not deployed to this node"
                                 + (" (a symbolic link there is refused)" if path.is_symlink() else ""))
        if self._verified.get(sha) != _key(st):
            if sha256_file(path) != sha:
                self.drop(sha)
                log.warning("blob %s was damaged (its sha256 differs): deleted", sha[:12])
                raise ModelFileError(f"{what} ({sha[:12]}) on this node was damaged since it was "
                                     f"deployed (its sha256 differs); it was deleted: deploy "
                                     f"again and it is uploaded anew")
            self._verified[sha] = _key(st)
        self._used[sha] = time.time()
        return path

    def _remember(self, sha: str, path: Path) -> None:
        if (st := self._regular(path)) is not None:
            self._verified[sha] = _key(st)

    def drop(self, sha: str) -> None:
        self.path(sha).unlink(missing_ok=True)
        self._verified.pop(sha, None)
        self._used.pop(sha, None)

    def _blobs(self) -> list[tuple[str, os.stat_result]]:
        out = []
        for p in self.dir.iterdir():
            if _SHA.fullmatch(p.name) and (st := self._regular(p)) is not None:
                out.append((p.name, st))
        return out

    def _idle(self, sha: str, st: os.stat_result, keep: set[str]) -> bool:
        """Whether nothing uses the blob: not kept, and no model folder links to it (a pushed
        folder's files are hard links to their blobs)."""
        return sha not in keep and st.st_nlink <= 1

    def _last_used(self, sha: str, st: os.stat_result) -> float:
        """When the blob was last written or used (time.time())."""
        return max(st.st_mtime, self._used.get(sha, 0.0))

    def figures(self, now: float | None = None) -> BlobFigures:
        keep, now = self.pinned(), time.time() if now is None else now
        blobs = self._blobs()
        idle = [(now - self._last_used(sha, st) >= self.grace_s, st.st_size)
                for sha, st in blobs if self._idle(sha, st, keep)]
        old = [size for past, size in idle if past]
        recent = [size for past, size in idle if not past]
        return BlobFigures(len(blobs), sum(st.st_size for _, st in blobs), len(old), sum(old),
                           len(recent), sum(recent))

    def collect(self, idle_s: float, need: int = 0, now: float | None = None) -> tuple[int, int]:
        """Delete the blobs nothing uses (not pinned, not linked from a model folder) that were
        not used for `idle_s`, the least recently used first; with `need`, only until that many
        bytes are free. Returns (files, bytes) deleted."""
        with self._lock:
            return self._collect(self.pinned(), idle_s, need, now)

    def _collect(self, keep: set[str], idle_s: float, need: int = 0,
                 now: float | None = None) -> tuple[int, int]:
        now = time.time() if now is None else now
        idle = []
        for sha, st in self._blobs():
            last = self._last_used(sha, st)
            if self._idle(sha, st, keep) and now - last >= idle_s:
                idle.append((last, sha, st.st_size))
        files = freed = 0
        for _, sha, size in sorted(idle):
            if need and freed >= need:
                break
            self.drop(sha)
            files, freed = files + 1, freed + size
        if files:
            log.info("deleted %d deployed files nothing used (%.1f MB)", files, freed / 1e6)
        return files, freed

    def clean_parts(self, now: float | None = None) -> int:
        """Delete partial uploads untouched for part_ttl_s; returns how many."""
        now = time.time() if now is None else now
        gone = 0
        for p in self.dir.glob("*.part"):
            st = self._regular(p)
            if st is None or now - st.st_mtime > self.part_ttl_s:
                with self._lock:
                    p.unlink(missing_ok=True)
                    self._declared.pop(p.stem, None)
                gone += 1
        if gone:
            log.info("deleted %d partial uploads nobody finished", gone)
        return gone
