"""Send model files to a node: chunked, resumable (the node keeps partial uploads), and
checked by sha256 on arrival. Files the node holds already are not sent again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from edgelite.manifest import DataFile, FileEntry, check_file
from edgelite.net import messages as m
from edgelite.net.link import NodeLink

log = logging.getLogger(__name__)
Progress = Callable[[str, int, int], None]  # (what, done, total)


def _read_chunk(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


async def push_files(link: NodeLink, root: Path, entries: list[FileEntry], chunk_bytes: int,
                     timeout_s: float, progress: Progress | None = None) -> int:
    """Upload the entries' graphs and data files (under `root`) the node lacks; returns bytes
    sent. A local file that is missing or not the manifest's size is named before anything is
    sent (the node checks each file's sha256 when it is complete)."""
    files = [DataFile(f.file, f.sha256, f.bytes) for e in entries for f in (e, *e.data)]
    sent = await send_files(link, root, files, chunk_bytes, timeout_s, progress)
    log.info("deploy %s: %d files of %d layers' (%d bytes sent)", link.name, len(files),
             len(entries), sent)
    return sent


async def send_files(link: NodeLink, root: Path, files: list[DataFile], chunk_bytes: int,
                     timeout_s: float, progress: Progress | None = None) -> int:
    """Upload the files (under `root`) the node does not hold, resuming partial ones where they
    stopped; returns the bytes sent now. Progress counts what the node holds of the total."""
    state = await link.request(m.FilesQuery(id=0, sha256=sorted({f.sha256 for f in files})),
                               m.FilesState, timeout_s)
    todo = list({f.sha256: f for f in files if f.sha256 not in state.have}.values())
    total = sum(e.bytes for e in todo)
    held = sent = 0
    for e in todo:
        offset = min(int(state.partial.get(e.sha256, 0)), e.bytes)
        held += offset
        path = await asyncio.to_thread(check_file, root / e.file, e.sha256, e.bytes, False)
        while chunk := await asyncio.to_thread(_read_chunk, path, offset, chunk_bytes):
            await link.request(m.Upload(id=0, sha256=e.sha256, offset=offset, total=e.bytes,
                                        data=chunk), m.UploadAck, timeout_s)
            offset += len(chunk)
            held += len(chunk)
            sent += len(chunk)
            if progress:
                progress(link.name, held, total)
    return sent
