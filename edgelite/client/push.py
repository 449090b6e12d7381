"""`edgelite push DIR --to HOST:PORT`: copy an export to a phone over the LAN.

The phone runs `edgelite node`; the export's files go to it as blobs (chunked; a broken transfer
resumes where it stopped; each file is checked by sha256 when complete), then the node makes
them a model folder, DATA_DIR/models/NAME, and says where. The client phone then chats with
`--model` that folder and needs no PC-side tools.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from edgelite import manifest as mf
from edgelite import paths
from edgelite.config import ClientConfig, WireLimits
from edgelite.errors import EdgeliteError
from edgelite.ids import NodeAddr
from edgelite.manifest import DataFile, sha256_file
from edgelite.net import messages as m
from edgelite.net.link import NodeLink
from edgelite.net.upload import Progress, send_files
from edgelite.node.shelf import plain_name


@dataclass(frozen=True)
class Pushed:
    path: str  # the model folder on the phone
    files: int
    bytes: int  # the export's size
    sent: int  # bytes sent by this push (less when the phone had some of it)


def export_files(model_dir: Path) -> list[DataFile]:
    """Every file of the export folder (the manifest's graphs and data, its tokenizer, ...),
    after checking the manifest lists nothing that is missing or of another size."""
    manifest = mf.load(model_dir)
    listed = {f.file: f for e in manifest.files for f in (e, *e.data)}
    for f in listed.values():
        mf.check_file(model_dir / f.file, f.sha256, f.bytes, verify_hash=False)
    out = []
    for path in sorted(p for p in model_dir.iterdir() if p.is_file() and not p.is_symlink()):
        if path.name.startswith("."):
            continue
        f = listed.get(path.name)
        out.append(DataFile(path.name, f.sha256, f.bytes) if f else
                   DataFile(path.name, sha256_file(path), path.stat().st_size))
    return out


async def push(model_dir: str | Path, to: NodeAddr, token: str, name: str | None = None,
               client: ClientConfig | None = None, progress: Progress | None = None) -> Pushed:
    root = Path(model_dir)
    cfg = client or ClientConfig()
    name = plain_name(name or await asyncio.to_thread(lambda: root.resolve().name), "--name")
    files = await asyncio.to_thread(export_files, root)
    # as this client (its kept key): the folder is its own, and it may push it again
    link = await NodeLink.open(to, token, None, WireLimits(), cfg.connect_timeout_s,
                               kv=paths.kv_key())
    try:
        sent = await send_files(link, root, files, cfg.deploy_chunk_bytes, cfg.deploy_timeout_s,
                                progress)
        stored = await link.request(m.ModelPut(id=0, name=name, files={f.file: f.sha256
                                                                      for f in files}),
                                    m.ModelStored, cfg.deploy_timeout_s)
    finally:
        await link.close()
    if stored.files != len(files):
        raise EdgeliteError(f"{to} kept {stored.files} files of {len(files)}")
    return Pushed(stored.path, len(files), sum(f.bytes for f in files), sent)
