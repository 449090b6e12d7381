"""Model folders pushed to this device (`edgelite push`): DATA_DIR/models/NAME/.

The files arrive as blobs (resumable, sha256-checked; node/blobs.py). A folder is made from
them only when all are there: each file is a hard link to its blob (a copy where links are not
possible), the manifest is read back and every file it lists is checked against it, and only
then does the folder take NAME (a rename; an older folder of that name is replaced whole). Names
from the wire are checked before they touch a path: a model name and its file names are plain
names (letters, digits, `.`, `_`, `-`), never paths. A folder belongs to the client that pushed
it (its KV domain, kept in NAME/.owner): another client cannot replace it, nor remove it.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from edgelite import manifest as mf
from edgelite.errors import EdgeliteError, ProtocolError
from edgelite.node.blobs import BlobStore, check_sha

log = logging.getLogger(__name__)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
OWNER_FILE = ".owner"  # in a pushed folder: who pushed it


def plain_name(value: str, what: str) -> str:
    if not _NAME.fullmatch(value) or value.endswith((".tmp", ".old")):
        raise ProtocolError(f"{what} {value[:80]!r} is not a plain name (letters, digits, . _ -; "
                            f"at most 64)")
    return value


@dataclass(frozen=True)
class ExportFolder:
    """An export's folder as `edgelite models` lists it (on a node's shelf, or on a device)."""

    path: Path
    title: str  # the model's own name (its manifest's)
    weights: str
    compute: str
    layers: int
    bytes: int  # its files together
    owner: str = ""  # on a shelf: who pushed it (a KV domain)


def folder_bytes(folder: Path) -> int:
    """The bytes of the files directly in `folder` (an export has no sub-folders)."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def read_export(folder: Path, owner: str = "") -> ExportFolder | None:
    """The folder's figures when it holds a readable export (else None, and why in the log)."""
    try:
        m = mf.load(folder)
        size = folder_bytes(folder)
    except (EdgeliteError, OSError) as exc:
        log.info("%s: not listed as an export: %s", folder, exc)
        return None
    return ExportFolder(folder, m.name, m.weights, m.compute, m.num_layers, size, owner)


class Shelf:
    def __init__(self, root: Path, blobs: BlobStore) -> None:
        self.dir = root / "models"
        self.blobs = blobs

    def owner(self, name: str) -> str | None:
        """Who pushed DATA_DIR/models/NAME (None: nobody recorded, or no such folder)."""
        try:
            return (self.dir / name / OWNER_FILE).read_text().strip() or None
        except OSError:
            return None

    def entries(self) -> list[ExportFolder]:
        """The folders here with a readable manifest, by name (a folder being made or replaced,
        or one that does not read, is left out)."""
        out = []
        for folder in sorted(self.dir.iterdir()) if self.dir.is_dir() else []:
            if not _NAME.fullmatch(folder.name) or folder.is_symlink() or not folder.is_dir():
                continue
            if (found := read_export(folder, self.owner(folder.name) or "")) is not None:
                out.append(found)
        return out

    def remove(self, name: str, owner: str) -> int:
        """Delete DATA_DIR/models/NAME, which `owner` pushed; the bytes it held. Its blobs stay
        (other folders or plans may use them) until nothing uses them (BlobStore.collect)."""
        plain_name(name, "model name")
        folder = self.dir / name
        if folder.is_symlink() or not folder.is_dir():
            raise EdgeliteError(f"no model {name} on this node")
        if self.owner(name) != owner:
            raise EdgeliteError(f"model {name} on this node was pushed by another client; only "
                                f"that client removes it")
        size = folder_bytes(folder)
        gone = self.dir / f".{name}.{secrets.token_hex(4)}.old"
        folder.rename(gone)  # gone from the list at once, whatever the delete takes
        shutil.rmtree(gone, ignore_errors=True)
        log.info("model %s removed (%.1f MB)", name, size / 1e6)
        return size

    def put(self, name: str, files: dict[str, str], owner: str = "") -> Path:
        """Make DATA_DIR/models/NAME from blobs (file name -> sha256) for `owner`; its path.
        A folder of that name another owner pushed is refused."""
        plain_name(name, "model name")
        held_by = self.owner(name)
        if held_by is not None and held_by != owner:
            raise EdgeliteError(f"model {name} on this node was pushed by another client; push "
                                f"yours under another name")
        for file, sha in files.items():
            plain_name(file, f"model {name}: file name")
            check_sha(sha)
        if mf.MANIFEST_NAME not in files:
            raise ProtocolError(f"model {name}: no {mf.MANIFEST_NAME} among its files")
        self.dir.mkdir(parents=True, exist_ok=True)
        tag = secrets.token_hex(4)
        staged = self.dir / f".{name}.{tag}.tmp"
        staged.mkdir()
        try:
            for file, sha in files.items():
                blob = self.blobs.verified(sha, f"model {name}: {file}")
                try:
                    os.link(blob, staged / file)
                except OSError:  # another file system, or links not allowed: copy
                    shutil.copyfile(blob, staged / file)
            (staged / OWNER_FILE).write_text(owner)
            m = mf.load(staged)
            for entry in m.files:  # the blobs were verified: equal sha256, equal content
                for f in (entry, *entry.data):
                    if f.file not in files:
                        raise EdgeliteError(f"model {name}: {f.file} is listed in its manifest "
                                            f"but was not pushed")
                    if files[f.file] != f.sha256:
                        raise EdgeliteError(f"model {name}: {f.file} is not the file its manifest "
                                            f"lists (sha256 differs)")
            final = self.dir / name
            old = self.dir / f".{name}.{tag}.old"
            if final.exists():
                final.rename(old)
            staged.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        log.info("model %s: %d files kept in %s", name, len(files), final)
        return final.resolve()
