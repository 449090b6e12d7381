"""Tensor files read lazily: a GGUF file or a folder of safetensors files (sharded or not).

Only the header is parsed when a file is opened (a GGUF's metadata and tensor table; each
safetensors shard's JSON header), so an unsupported or damaged model is refused in
milliseconds. A tensor's bytes are read when asked for (`raw`), with `pread` into a buffer of
their own: nothing maps the whole file, so the process holds the tensors being converted, not
the model. Every tensor's extent is checked against its file's size when the file is opened: a
truncated file is named with the first tensor it cuts.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgelite.errors import SourceNotFound

GGUF_MAGIC = b"GGUF"
GGUF_ALIGNMENT = 32  # unless general.alignment says otherwise
Rows = tuple[int, int] | None  # rows a..b of a tensor (its first dimension), or all of it
MAX_HEADER_BYTES = 1 << 28  # a safetensors header (JSON) larger than this is not one
# GGUF metadata value types: (struct format, size) of the scalars; 8 string, 9 array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
              "BOOL": np.bool_}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    kind: str  # GGUF: a ggml type name (F32, Q4_0, Q6_K, ...); safetensors: its dtype (BF16, ...)
    shape: tuple[int, ...]  # as PyTorch lists it: (rows, columns) for a matrix
    path: Path
    offset: int  # of its first byte in the file
    nbytes: int


class TensorFile:
    """Tensors by name; what both source formats give."""

    path: Path
    tensors: dict[str, TensorInfo]

    def has(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            raise SourceNotFound(f"{self.path}: no tensor {name!r}")
        return t

    def raw(self, name: str, rows: Rows = None) -> np.ndarray:
        """The tensor's bytes as stored (uint8), read now into memory of its own: all of them,
        or those of rows a..b (the first dimension)."""
        t = self.info(name)
        start, n = t.offset, t.nbytes
        if rows is not None:
            per = t.nbytes // t.shape[0]
            start, n = t.offset + rows[0] * per, (rows[1] - rows[0]) * per
        buf = np.empty(n, np.uint8)
        with open(t.path, "rb") as f:
            got = f.readinto(memoryview(buf)) if f.seek(start) == start else 0
        if got != n:
            raise SourceNotFound(f"{t.path}: tensor {name} is cut short ({got} of {n} bytes)")
        return buf

    def float(self, name: str, rows: Rows = None) -> np.ndarray:
        """A tensor as float32 in its PyTorch shape (rows a..b only, when given)."""
        raise NotImplementedError

    def shape(self, name: str, rows: Rows = None) -> tuple[int, ...]:
        shape = self.info(name).shape
        return shape if rows is None else (rows[1] - rows[0], *shape[1:])

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _check_extents(tensors: dict[str, TensorInfo]) -> None:
    sizes: dict[Path, int] = {}
    for t in tensors.values():
        size = sizes.setdefault(t.path, t.path.stat().st_size)
        if t.offset + t.nbytes > size:
            raise SourceNotFound(f"{t.path}: truncated: tensor {t.name} needs bytes {t.offset}.."
                                 f"{t.offset + t.nbytes}, the file has {size}")


# ---- GGUF ---------------------------------------------------------------------------------
class _Cursor:
    """Reads GGUF header values from an open file, in order."""

    def __init__(self, f: Any, path: Path) -> None:
        self.f, self.path = f, path

    def take(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise SourceNotFound(f"{self.path}: a damaged or truncated GGUF file (its header ends "
                                 f"early)")
        return b

    def scalar(self, kind: int) -> Any:
        fmt, size = _SCALARS[kind]
        return struct.unpack(fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.scalar(10)
        if n > MAX_HEADER_BYTES:
            raise SourceNotFound(f"{self.path}: a damaged or truncated GGUF file (a string of {n} "
                                 f"bytes)")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(kind)
        if kind == 8:
            return self.string()
        if kind == 9:
            item, count = self.scalar(4), self.scalar(10)
            if item in _SCALARS:  # one read for the whole array
                fmt, size = _SCALARS[item]
                if count * size > MAX_HEADER_BYTES:
                    raise SourceNotFound(f"{self.path}: a damaged or truncated GGUF file (an array "
                                         f"of {count} values)")
                return list(np.frombuffer(self.take(count * size), np.dtype(fmt)))
            return [self.value(item) for _ in range(count)]
        raise SourceNotFound(f"{self.path}: a damaged or truncated GGUF file (metadata of unknown "
                             f"type {kind})")


class GGUFFile(TensorFile):
    """A GGUF file: `meta` (every metadata key) and its tensors, each in ggml's own type."""

    def __init__(self, path: Path) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path
        try:
            f = open(path, "rb")
        except OSError as exc:
            raise SourceNotFound(f"{path}: cannot read it: {exc.strerror or exc}") from None
        with f:
            c = _Cursor(f, path)
            if f.read(4) != GGUF_MAGIC:
                raise SourceNotFound(f"{path}: not a GGUF file (it does not start with the GGUF "
                                     f"magic bytes)")
            version = c.scalar(4)
            if version not in (2, 3):
                raise SourceNotFound(f"{path}: a damaged or truncated GGUF file (version "
                                     f"{version}; this reads 2 and 3)")
            n_tensors, n_kv = c.scalar(10), c.scalar(10)
            if n_tensors > 1 << 20 or n_kv > 1 << 20:
                raise SourceNotFound(f"{path}: a damaged or truncated GGUF file ({n_tensors} "
                                     f"tensors, {n_kv} metadata keys)")
            self.meta: dict[str, Any] = {}
            for _ in range(n_kv):
                key = c.string()
                self.meta[key] = c.value(c.scalar(4))
            table = []
            for _ in range(n_tensors):
                name, ndim = c.string(), c.scalar(4)
                if ndim > 8:
                    raise SourceNotFound(f"{path}: a damaged or truncated GGUF file (tensor "
                                         f"{name} has {ndim} dimensions)")
                dims = [c.scalar(10) for _ in range(ndim)]
                table.append((name, dims, c.scalar(4), c.scalar(10)))
            align = int(self.meta.get("general.alignment", GGUF_ALIGNMENT))
            start = -(-f.tell() // align) * align
        self.tensors = {}
        for name, dims, kind, offset in table:
            try:
                qtype = GGMLQuantizationType(kind)
                block, size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise SourceNotFound(f"{path}: tensor {name} has an unknown ggml type {kind}") from None
            count = int(np.prod(dims, dtype=np.int64)) if dims else 1
            if dims and dims[0] % block:
                raise SourceNotFound(f"{path}: tensor {name}: {dims[0]} columns are not whole "
                                     f"{qtype.name} blocks of {block}")
            # GGUF lists dimensions innermost first; PyTorch's order is the reverse
            self.tensors[name] = TensorInfo(name, qtype.name, tuple(reversed(dims)), path,
                                            start + offset, count // block * size)
        _check_extents(self.tensors)

    @property
    def architecture(self) -> str:
        return str(self.meta.get("general.architecture", ""))

    def blocks(self, name: str, rows: Rows = None) -> np.ndarray:
        """A tensor's raw bytes as the gguf package shapes them: (rows, row bytes)."""
        shape = self.shape(name, rows)
        n = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        return self.raw(name, rows).reshape(n, -1)

    def float(self, name: str, rows: Rows = None) -> np.ndarray:
        """Float tensors as they are; quantized ones dequantized by the gguf package."""
        t, shape = self.info(name), self.shape(name, rows)
        dtypes = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
        if t.kind == "BF16":
            return _bf16(self.raw(name, rows)).reshape(shape)
        if t.kind not in dtypes:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            return dequantize(self.blocks(name, rows), GGMLQuantizationType[t.kind]).astype(
                np.float32, copy=False).reshape(shape)
        return self.raw(name, rows).view(dtypes[t.kind]).astype(np.float32).reshape(shape)


def _bf16(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bytes as float32 (exact: the top half of a float32)."""
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


# ---- safetensors --------------------------------------------------------------------------
class Safetensors(TensorFile):
    """A HF folder's weights: model.safetensors, or the shards model.safetensors.index.json
    lists (any *.safetensors file when there is neither)."""

    def __init__(self, folder: Path) -> None:
        self.path = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                shards = sorted({folder / str(v) for v in weight_map.values()})
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise SourceNotFound(f"{index}: not a readable shard index ({exc})") from None
        else:
            shards = sorted(folder.glob("*.safetensors"))
        if not shards:
            raise SourceNotFound(f"{folder}: no *.safetensors weights (other weight formats, such "
                                 f"as pytorch_model.bin, are not read: save the model with "
                                 f"safe_serialization)")
        self.tensors = {}
        for shard in shards:
            self.tensors.update(_safetensors_header(shard))
        _check_extents(self.tensors)

    def float(self, name: str, rows: Rows = None) -> np.ndarray:
        t, shape = self.info(name), self.shape(name, rows)
        if t.kind not in ("F32", "F16", "F64", "BF16"):
            raise SourceNotFound(f"{t.path}: tensor {name} is {t.kind}, not a float tensor")
        raw = self.raw(name, rows)
        if t.kind == "BF16":
            return _bf16(raw).reshape(shape)
        return raw.view(_ST_DTYPES[t.kind]).astype(np.float32).reshape(shape)


def _safetensors_header(path: Path) -> dict[str, TensorInfo]:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= MAX_HEADER_BYTES:
                raise SourceNotFound(f"{path}: not a safetensors file (header length {n})")
            text = f.read(n)
        header = json.loads(text)
    except OSError as exc:
        raise SourceNotFound(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise SourceNotFound(f"{path}: a damaged or truncated safetensors file ({exc})") from None
    if type(header) is not dict:
        raise SourceNotFound(f"{path}: a damaged safetensors header")
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = spec["dtype"], tuple(int(d) for d in spec["shape"]), spec["data_offsets"]
            item = np.dtype(_ST_DTYPES[dtype]).itemsize
        except (KeyError, TypeError, ValueError) as exc:
            raise SourceNotFound(f"{path}: tensor {name}: a damaged header entry ({exc})") from None
        if b - a != int(np.prod(shape, dtype=np.int64)) * item or a < 0:
            raise SourceNotFound(f"{path}: tensor {name}: its {b - a} bytes do not hold {dtype} "
                                 f"{list(shape)}")
        out[name] = TensorInfo(name, dtype, shape, path, 8 + n + a, b - a)
    return out


def open_source(path: Path) -> TensorFile:
    """A .gguf file or a HF folder's safetensors, headers read."""
    return GGUFFile(path) if path.suffix == ".gguf" else Safetensors(path)
