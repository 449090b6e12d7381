"""Content-addressed store for deployed model files: DIR/blobs/<sha256>.

Names from the wire are never used as paths: a blob is named only by a validated sha256.
Uploads append to <sha256>.part at the stated offset (so a broken transfer resumes where it
stopped) and become a blob only when the whole file hashes to its name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from edgelite.errors import ModelFileError, ProtocolError
from edgelite.manifest import sha256_file

_SHA = re.compile(r"^[0-9a-f]{64}$")


def check_sha(value: object) -> str:
    if not isinstance(value, str) or not _SHA.match(value):
        raise ProtocolError(f"not a sha256 hex digest: {str(value)[:80]!r}")
    return value


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.dir = root / "blobs"
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, sha: str) -> Path:
        return self.dir / check_sha(sha)

    def has(self, sha: str) -> bool:
        return self.path(sha).is_file()

    def partial(self, sha: str) -> int:
        part = self.dir / f"{check_sha(sha)}.part"
        return part.stat().st_size if part.is_file() else 0

    def append(self, sha: str, offset: int, total: int, data: bytes) -> int:
        """Write a chunk; returns bytes held. Completes (hash-checked) when `total` is reached."""
        if self.has(sha):
            return total
        part = self.dir / f"{check_sha(sha)}.part"
        held = self.partial(sha)
        if offset != held:
            raise ProtocolError(f"upload {sha[:12]}: chunk at offset {offset}, expected {held}")
        if held + len(data) > total:
            raise ProtocolError(f"upload {sha[:12]}: chunk runs past the stated size {total}")
        with open(part, "ab") as f:
            f.write(data)
            if held + len(data) == total:
                f.flush()
                os.fsync(f.fileno())
        held += len(data)
        if held == total:
            if sha256_file(part) != sha:
                part.unlink()
                raise ModelFileError(f"upload {sha[:12]}: content does not hash to its name; "
                                     f"discarded")
            part.rename(self.path(sha))
        return held

