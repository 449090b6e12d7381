"""Read and validate the exporter's manifest.json (shared by the exporter and the runtime).

The planner reads only this file; it never needs the ONNX files themselves.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgelite.errors import ManifestError, ModelFileError

FORMAT = "edgelite-model/1"
MANIFEST_NAME = "manifest.json"
ONNX_MAGIC = b"\x08"  # protobuf field 1 (ir_version), varint: every ONNX ModelProto starts so


@dataclass(frozen=True)
class FileEntry:
    file: str
    sha256: str
    bytes: int
    param_bytes: int
    flops_per_token: int = 0
    activation_bytes_per_token: int = 0
    kv_bytes_per_token: int = 0


@dataclass(frozen=True)
class Manifest:
    name: str
    architecture: str
    dtype: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    rope: dict[str, Any]
    eos_token_ids: list[int]
    chat_template: str | None
    tokenizer: str
    embed: FileEntry
    head: FileEntry
    layers: list[FileEntry]
    fingerprint: str
    quantization: dict[str, Any] | None = None
    verification: dict[str, Any] = field(default_factory=dict)
    special_tokens: dict[str, Any] = field(default_factory=dict)  # bos/eos text for the template
    root: Path = Path(".")

    @property
    def files(self) -> list[FileEntry]:
        return [self.embed, *self.layers, self.head]

    def path(self, entry: FileEntry) -> Path:
        return self.root / entry.file

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("root")
        return {"format": FORMAT, **data}


def fingerprint_of(sha256s: list[str]) -> str:
    """Names the model everywhere: a hash over all files' sha256, in chain order."""
    return hashlib.sha256("\n".join(sha256s).encode()).hexdigest()[:32]


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _entry(raw: Any, where: str) -> FileEntry:
    if not isinstance(raw, dict):
        raise ManifestError(f"{where}: expected an object, got {type(raw).__name__}")
    try:
        return FileEntry(**{k: raw[k] for k in FileEntry.__dataclass_fields__ if k in raw})
    except TypeError as exc:
        raise ManifestError(f"{where}: {exc}") from exc


def _check_file_name(name: str, where: str) -> None:
    if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith("."):
        raise ManifestError(f"{where}: file name {name!r} must be a plain name inside the folder")


def parse(data: dict[str, Any], root: Path) -> Manifest:
    fmt = data.get("format")
    if fmt != FORMAT:
        raise ManifestError(f"{root / MANIFEST_NAME}: unknown manifest format {fmt!r}, "
                            f"this edgelite reads {FORMAT!r}")
    required = [k for k in Manifest.__dataclass_fields__ if k not in ("root",)]
    optional = {"quantization", "verification", "special_tokens"}
    missing = [k for k in required if k not in data and k not in optional]
    if missing:
        raise ManifestError(f"{root / MANIFEST_NAME}: missing fields {', '.join(missing)}")
    fields = {k: data[k] for k in required if k in data}
    fields["embed"] = _entry(data["embed"], "embed")
    fields["head"] = _entry(data["head"], "head")
    if not isinstance(data["layers"], list) or not data["layers"]:
        raise ManifestError(f"{root / MANIFEST_NAME}: 'layers' must be a non-empty list")
    fields["layers"] = [_entry(e, f"layers[{i}]") for i, e in enumerate(data["layers"])]
    m = Manifest(**fields, root=root)
    if len(m.layers) != m.num_layers:
        raise ManifestError(f"{root / MANIFEST_NAME}: num_layers is {m.num_layers} "
                            f"but {len(m.layers)} layer files are listed")
    for i, e in enumerate(m.files):
        _check_file_name(e.file, f"file #{i}")
    _check_file_name(m.tokenizer, "tokenizer")
    if fingerprint_of([e.sha256 for e in m.files]) != m.fingerprint:
        raise ManifestError(f"{root / MANIFEST_NAME}: fingerprint does not match the files' sha256")
    return m


def load(model_dir: str | Path) -> Manifest:
    """Read DIR/manifest.json (no file checks: the planner needs only this)."""
    root = Path(model_dir)
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{path}: no manifest (is {root} a folder written by edgelite-export?)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path}: not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ManifestError(f"{path}: expected a JSON object")
    return parse(data, root)


def check_file(manifest: Manifest, entry: FileEntry, verify_hash: bool = True) -> Path:
    """The file's path, after checking it exists, has the listed size and (optionally) sha256."""
    path = manifest.path(entry)
    if not path.is_file():
        raise ModelFileError(f"{path}: missing (listed in the manifest)")
    size = path.stat().st_size
    if size != entry.bytes:
        raise ModelFileError(f"{path}: {size} bytes on disk, manifest says {entry.bytes} "
                             f"(truncated or replaced?)")
    if verify_hash and sha256_file(path) != entry.sha256:
        raise ModelFileError(f"{path}: sha256 differs from the manifest (corrupt or replaced)")
    return path


def write(manifest: Manifest, out_dir: Path) -> Path:
    path = out_dir / MANIFEST_NAME
    path.write_text(json.dumps(manifest.to_json(), indent=1))
    return path
