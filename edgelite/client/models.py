"""The exports this device and its nodes keep (`edgelite models`): list them, remove one, and
delete the deployed files nothing uses any more.

On this device an export is any folder with a manifest.json: those under the node's data
folder (DATA_DIR/models/NAME, where `edgelite push` puts them) and under the folders named.
A node answers for its own: its model folders (a client removes only those it pushed) and its
deployed files (blobs, which it deletes when nothing has used them for a while; `gc` asks now).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from edgelite import manifest as mf
from edgelite import paths
from edgelite.config import ClientConfig, NodeConfig
from edgelite.errors import EdgeliteError
from edgelite.ids import NodeAddr
from edgelite.net import messages as m
from edgelite.net.link import ask_once
from edgelite.node.blobs import BlobFigures, BlobStore
from edgelite.node.shelf import ExportFolder, folder_bytes, read_export

R = TypeVar("R", bound=m.Message)


@dataclass(frozen=True)
class NodeModels:
    """What one node keeps."""

    node: NodeAddr
    models: list[m.ShelvedModel]
    blobs: m.BlobSummary


def local_models(folders: list[Path]) -> list[ExportFolder]:
    """The exports in `folders`: each folder that is one, and each sub-folder that is one
    (once each, by path)."""
    seen: dict[Path, ExportFolder] = {}
    for folder in folders:
        if not folder.is_dir():
            continue
        candidates = [folder] if (folder / mf.MANIFEST_NAME).is_file() else sorted(
            p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        for c in candidates:
            if (c / mf.MANIFEST_NAME).is_file() and (found := read_export(c)) is not None:
                seen.setdefault(c.resolve(), found)
    return list(seen.values())


def remove_local(folder: Path) -> int:
    """Delete an export folder; the bytes it held. Only a folder with a manifest.json (an
    export) is deleted, and only its files: a folder holding sub-folders is refused."""
    if folder.is_symlink() or not folder.is_dir():
        raise EdgeliteError(f"{folder}: no such folder")
    if not (folder / mf.MANIFEST_NAME).is_file():
        raise EdgeliteError(f"{folder} is not an export (it has no {mf.MANIFEST_NAME}); not deleted")
    if any(p.is_dir() and not p.is_symlink() for p in folder.iterdir()):
        raise EdgeliteError(f"{folder} holds other folders: not an export as edgelite-export "
                            f"writes it; delete it yourself if you mean to")
    size = folder_bytes(folder)
    shutil.rmtree(folder)
    return size


def local_blobs(data_dir: Path) -> BlobFigures | None:
    """The deployed files a node with this data folder keeps (None: it has none)."""
    if not (data_dir / "blobs").is_dir():
        return None
    return BlobStore(data_dir, grace_s=NodeConfig.blob_grace_s).figures()


def collect_local(data_dir: Path) -> tuple[int, int]:
    """Delete the deployed files of a node with this data folder that no model folder links to
    and that were not used within the node's grace time; (files, bytes). A node running there
    keeps what it has loaded (its files stay open) and uploads the rest again when deployed."""
    if not (data_dir / "blobs").is_dir():
        return 0, 0
    return BlobStore(data_dir).collect(NodeConfig.blob_grace_s)


async def _ask(addr: NodeAddr, token: str, msg: m.Message, reply: type[R], cfg: ClientConfig) -> R:
    # as this client (its kept key): the folders it pushed are its own
    return await ask_once(addr, token, msg, reply, cfg.connect_timeout_s, cfg.request_timeout_s,
                          kv=paths.kv_key())


async def node_models(addr: NodeAddr, token: str, cfg: ClientConfig | None = None) -> NodeModels:
    state = await _ask(addr, token, m.ModelsQuery(id=0), m.ModelsState, cfg or ClientConfig())
    return NodeModels(addr, state.models, state.blobs)


async def remove_on_node(addr: NodeAddr, token: str, name: str,
                         cfg: ClientConfig | None = None) -> int:
    done = await _ask(addr, token, m.ModelRemove(id=0, name=name), m.ModelRemoved,
                      cfg or ClientConfig())
    return done.bytes


async def collect_on_node(addr: NodeAddr, token: str,
                          cfg: ClientConfig | None = None) -> tuple[int, int]:
    done = await _ask(addr, token, m.BlobsCollect(id=0), m.BlobsCollected, cfg or ClientConfig())
    return done.files, done.bytes
