"""Constant folding at load, in numpy, into pages the kernel can take back.

Exports keep weights as compactly as they are exact (a K-quant's scales as float16 x small
integers, codes narrower than their storage) and their graphs compute the wide form
(Cast/Mul/Reshape/...). Left to onnxruntime, that folding makes heap tensors it keeps beside the
packed copy its kernels use: measured on a 1 B layer, 60 MiB resident for 34 MiB of weights.

Here the graph's constant part is computed in numpy, one node at a time (an intermediate is
freed after its last use), and every result the rest of the graph reads is written to an
unlinked file next to the weights, mapped read-only and handed to onnxruntime as an initializer
(`SessionOptions.add_initializer`: no copy). Once the session is made and has packed what it
packs, `Folded.release` tells the kernel the mapped pages are not needed: they leave the
resident set, and are read back from the file should onnxruntime ever touch them again.
Measured on the same layer: 54 MiB resident, the same outputs bit for bit.

The graph keeps a declaration of each folded tensor (onnxruntime wants one for the name); its
external data location names a file that exists in the weights' folder, and onnxruntime, given
the tensor by `add_initializer`, never reads it. Ops without a numpy rule here are left to
onnxruntime, as before.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgelite.engine.onnxgraph import (  # (protobuf field numbers: onnxgraph.py, their one home)
    ATTR_I,
    ATTR_INTS,
    ATTR_NAME,
    ATTR_S,
    EXTERNAL,
    GRAPH_INIT,
    GRAPH_NODE,
    GRAPH_OUTPUT,
    MODEL_GRAPH,
    NODE_ATTR,
    NODE_DOMAIN,
    NODE_INPUT,
    NODE_OP,
    NODE_OUTPUT,
    TENSOR_DIMS,
    TENSOR_EXTERNAL,
    TENSOR_INT32,
    TENSOR_INT64,
    TENSOR_LOCATION,
    TENSOR_NAME,
    TENSOR_RAW,
    TENSOR_TYPE,
    Field,
    encode,
    fields,
    value_name,
)
from edgelite.errors import ModelFileError

log = logging.getLogger(__name__)

DTYPES: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.float32), 2: np.dtype(np.uint8), 3: np.dtype(np.int8), 4: np.dtype(np.uint16),
    5: np.dtype(np.int16), 6: np.dtype(np.int32), 7: np.dtype(np.int64), 9: np.dtype(np.bool_),
    10: np.dtype(np.float16), 11: np.dtype(np.float64), 12: np.dtype(np.uint32),
    13: np.dtype(np.uint64)}
CODES = {v: k for k, v in DTYPES.items()}
ALIGN = mmap.PAGESIZE  # each folded tensor starts on a page of its own
MADV_POPULATE_READ = 22  # Linux 5.14 on: map a range's pages now (Python's mmap has no name for it)
# inputs at least this large are read, and their results computed, this many bytes at a time
CHUNK_BYTES = 8 << 20
# a folded result holds at most this many times the bytes of the initializers it comes from, and
# FOLD_SLACK more (the exporter's widest: 4-bit codes as float32, 8x); more is refused up front
FOLD_GROWTH = 16
FOLD_SLACK = 1 << 16


@dataclass
class Node:
    op: str
    domain: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any]


def _ints(value: bytes | int, wire: int) -> list[int]:
    """A repeated int64 field's items (packed or one per field)."""
    if wire == 0:
        return [_signed(int(value))]
    out, pos, buf = [], 0, value
    assert isinstance(buf, bytes)
    while pos < len(buf):
        n = shift = 0
        while True:
            b = buf[pos]
            pos += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        out.append(_signed(n))
    return out


def _signed(n: int) -> int:
    return n - (1 << 64) if n >= 1 << 63 else n


def _node(buf: bytes) -> Node:
    n = Node("", "", [], [], {})
    for number, _, value in fields(buf):
        text = bytes(value).decode() if number in (NODE_INPUT, NODE_OUTPUT, NODE_OP, NODE_DOMAIN) else ""  # type: ignore[arg-type]
        if number == NODE_INPUT:
            n.inputs.append(text)
        elif number == NODE_OUTPUT:
            n.outputs.append(text)
        elif number == NODE_OP:
            n.op = text
        elif number == NODE_DOMAIN:
            n.domain = text
        elif number == NODE_ATTR:
            name, one, ints = "", None, []  # type: ignore[var-annotated]
            for an, aw, av in fields(value):  # type: ignore[arg-type]
                if an == ATTR_NAME:
                    name = bytes(av).decode()  # type: ignore[arg-type]
                elif an == ATTR_I:
                    one = _signed(int(av))  # type: ignore[arg-type]
                elif an == ATTR_S:
                    one = bytes(av).decode()  # type: ignore[arg-type]
                elif an == ATTR_INTS:
                    ints += _ints(av, aw)
            n.attrs[name] = ints or one
    return n


@dataclass
class Tensor:
    """An initializer as the graph declares it: where its bytes are."""

    name: str
    dtype: np.dtype[Any]
    dims: list[int]
    raw: bytes | None = None
    ints: list[int] = field(default_factory=list)
    location: str = ""
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return (int(np.prod(self.dims)) if self.dims else 1) * self.dtype.itemsize

    def _read(self, folder: Path, start: int, count: int) -> np.ndarray:
        """`count` elements from element `start` of its external data."""
        a = np.fromfile(folder / self.location, self.dtype, count,
                        offset=self.offset + start * self.dtype.itemsize)
        if a.size != count:
            raise ModelFileError(f"{self.location}: {self.name} needs {self.nbytes} bytes at offset "
                                 f"{self.offset}; the file is shorter")
        return a

    def load_rows(self, folder: Path, lo: int, hi: int) -> np.ndarray:
        """Rows lo..hi (of the first axis)."""
        if not self.location:
            return self.load(folder)[lo:hi]
        per = int(np.prod(self.dims[1:]))
        return self._read(folder, lo * per, (hi - lo) * per).reshape([hi - lo, *self.dims[1:]])

    def load(self, folder: Path) -> np.ndarray:
        count = int(np.prod(self.dims)) if self.dims else 1
        if self.location:
            a = self._read(folder, 0, count)
        elif self.raw is not None:
            a = np.frombuffer(self.raw, self.dtype, count).copy()
        else:
            a = np.array(self.ints, self.dtype)
        return a.reshape(self.dims)


def tensor(buf: bytes) -> Tensor | None:
    """An initializer (TensorProto bytes) as it declares itself; None for a form left to
    onnxruntime (float_data and the like, external data without a location)."""
    t = Tensor("", DTYPES[1], [])
    code, external = 0, False
    for number, wire, value in fields(buf):
        if number == TENSOR_DIMS:
            t.dims += _ints(value, wire)
        elif number == TENSOR_TYPE:
            code = int(value)
        elif number == TENSOR_NAME:
            t.name = bytes(value).decode()  # type: ignore[arg-type]
        elif number == TENSOR_RAW:
            t.raw = bytes(value)  # type: ignore[arg-type]
        elif number in (TENSOR_INT32, TENSOR_INT64):
            t.ints += _ints(value, wire)
        elif number == TENSOR_LOCATION:
            external = int(value) == EXTERNAL
        elif number == TENSOR_EXTERNAL:
            entry = {n: bytes(v) for n, _, v in fields(value)}  # type: ignore[arg-type]
            key, val = entry.get(1, b"").decode(), entry.get(2, b"").decode()
            if key == "location":
                t.location = val
            elif key == "offset":
                t.offset = int(val)
        else:
            return None  # (float_data and the like: left to onnxruntime)
    if code not in DTYPES or (external and not t.location):
        return None
    t.dtype = DTYPES[code]
    return t


def _reshape(x: np.ndarray, shape: np.ndarray) -> np.ndarray:
    dims = [x.shape[i] if d == 0 else int(d) for i, d in enumerate(shape.tolist())]
    return x.reshape(dims)


def _unsqueeze(x: np.ndarray, axes: np.ndarray) -> np.ndarray:
    rank = x.ndim + len(axes)
    for a in sorted(int(v) % rank for v in axes.tolist()):
        x = np.expand_dims(x, a)
    return x


def _shift(x: np.ndarray, by: np.ndarray, left: bool) -> np.ndarray:
    by = by.astype(x.dtype)
    out = np.left_shift(x, by) if left else np.right_shift(x, by)
    return out.astype(x.dtype)  # (uint8 stays uint8: the bits shifted out are lost, as in ONNX)


# op -> (its numpy rule: the node's attributes and input arrays -> its output)
def _predicted(n: Node, args: list[np.ndarray]) -> int:
    """The bytes node n's result will take, from its inputs' shapes (before it is computed)."""
    if n.op in ("Add", "Mul"):
        try:
            shape = np.broadcast_shapes(*(a.shape for a in args))
        except ValueError as exc:
            raise ValueError(f"{n.op} of shapes that do not broadcast") from exc
        return math.prod(shape) * np.result_type(*args).itemsize
    if n.op == "Gather":
        data, axis = args[0], int(n.attrs.get("axis", 0))
        row = math.prod(data.shape) // max(1, data.shape[axis % max(1, data.ndim)]) if data.ndim else 1
        return math.prod(args[1].shape) * row * data.dtype.itemsize
    if n.op == "Concat":
        return sum(a.nbytes for a in args)
    if n.op == "Cast":
        return math.prod(args[0].shape) * DTYPES[n.attrs["to"]].itemsize
    return args[0].nbytes


def _apply(n: Node, args: list[np.ndarray], limit: int) -> np.ndarray:
    """Node n's result, refused (ValueError) when it would take more than `limit` bytes."""
    _bounded(n.outputs[0], _predicted(n, args), limit)
    return np.asarray(RULES[n.op](n.attrs, args))


def _bounded(name: str, need: int, limit: int) -> None:  # (ValueError past the limit)
    if need > limit:
        raise ValueError(f"{name[:80]} would take {need} bytes, over {limit} "
                         f"({FOLD_GROWTH}x the initializers it is computed from)")


RULES: dict[str, Callable[[dict[str, Any], list[np.ndarray]], np.ndarray]] = {
    "Cast": lambda at, x: x[0].astype(DTYPES[at["to"]]),
    "Mul": lambda at, x: np.multiply(x[0], x[1]).astype(np.result_type(x[0], x[1])),
    "Add": lambda at, x: np.add(x[0], x[1]).astype(np.result_type(x[0], x[1])),
    "Reshape": lambda at, x: _reshape(x[0], x[1]),
    "Unsqueeze": lambda at, x: _unsqueeze(x[0], x[1]),
    "Transpose": lambda at, x: np.ascontiguousarray(np.transpose(x[0], at.get("perm"))),
    "Gather": lambda at, x: np.take(x[0], x[1], axis=int(at.get("axis", 0))),
    "Concat": lambda at, x: np.concatenate(x, axis=int(at["axis"])),
    "BitShift": lambda at, x: _shift(x[0], x[1], at.get("direction") == "LEFT"),
}


@dataclass
class Folded:
    """A graph with its constant part computed: the graph to give onnxruntime, the tensors it
    declares but does not hold (to hand over with `add_initializer`), and the mapping they
    live in."""

    model: bytes
    names: list[str]
    values: list[Any]  # OrtValues over `mapping`
    mapping: mmap.mmap | None
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (offset, bytes)

    def add_to(self, options: Any) -> None:
        for name, value in zip(self.names, self.values, strict=True):
            options.add_initializer(name, value)

    def release(self) -> None:
        """The mapped pages leave the resident set (onnxruntime has packed what it packs)."""
        if self.mapping is not None and hasattr(self.mapping, "madvise"):
            try:
                self.mapping.madvise(mmap.MADV_DONTNEED)
            except (OSError, AttributeError) as exc:  # (a platform without it: pages stay)
                log.debug("madvise: %s", exc)

    def populate(self, prefixes: tuple[str, ...]) -> None:
        """The pages of the tensors whose names start with one of `prefixes` mapped in now: an
        operator that reads them in place at every step (edgelite's (engine/kernels)) would otherwise
        take their page faults in the first step (a prompt's first token)."""
        if self.mapping is None or not prefixes:
            return
        for name, (start, size) in self.spans.items():
            if not name.startswith(prefixes) or not size:
                continue
            length = -(-size // ALIGN) * ALIGN  # (start is on a page: ALIGN)
            try:
                self.mapping.madvise(MADV_POPULATE_READ, start, min(length, len(self.mapping) - start))
            except (OSError, AttributeError, ValueError):  # (older kernels: touch a byte a page)
                int(np.frombuffer(self.mapping, np.uint8, size, start)[::ALIGN].sum())


class _Evaluator:
    """Computes a folded tensor from the initializers: whole, or, when its inputs include
    large tensors and every node on the way works row by row on them (elementwise ops,
    Gather/Concat/Unsqueeze off the first axis, Reshape keeping it), a slice of rows at a time
    (a 100 MB table of narrow codes widened through ~30 nodes would otherwise hold several
    copies at once)."""

    def __init__(self, nodes: list[Node], folded: list[int], tensors: dict[str, Tensor],
                 folder: Path) -> None:
        self.producer = {nodes[k].outputs[0]: nodes[k] for k in folded}
        self.tensors, self.folder = tensors, folder
        self.limit = 0  # the bytes a result of the cone being computed may take (write)

    def _cone(self, name: str) -> list[Node]:
        """The folded nodes `name` depends on, in an order that computes each input first."""
        order: list[Node] = []
        seen: set[str] = set()

        def visit(t: str) -> None:
            n = self.producer.get(t)
            if n is None or t in seen:
                return
            seen.add(t)
            for i in n.inputs:
                visit(i)
            order.append(n)
        visit(name)
        return order

    def write(self, name: str, out: Any, pos: int) -> tuple[int, np.dtype[Any], tuple[int, ...]]:
        """Computes `name`, writes it at `pos` of `out`: (pos, dtype, shape)."""
        cone = self._cone(name)
        leaves = {i for n in cone for i in n.inputs if i not in self.producer}
        self.limit = FOLD_GROWTH * sum(self.tensors[t].nbytes for t in leaves) + FOLD_SLACK
        try:
            done = self._by_rows(cone, out)
            if done is None:
                out.seek(pos)
                out.truncate()
                result = np.ascontiguousarray(self._whole(cone))
                out.write(memoryview(result).cast("B") if result.size else b"")
                done = result.dtype, result.shape
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise ModelFileError(f"folding {name}: {exc}") from exc
        return pos, done[0], done[1]

    def _whole(self, cone: list[Node]) -> np.ndarray:
        left: dict[str, int] = {}  # tensor -> nodes of the cone yet to read it
        for n in cone:
            for i in n.inputs:
                left[i] = left.get(i, 0) + 1
        values: dict[str, np.ndarray] = {}
        for n in cone:
            args = [values[i] if i in values else self.tensors[i].load(self.folder) for i in n.inputs]
            result = _apply(n, args, self.limit)
            del args
            for i in n.inputs:
                left[i] -= 1
                if not left[i]:
                    values.pop(i, None)
            values[n.outputs[0]] = result
        return values[cone[-1].outputs[0]]

    def _by_rows(self, cone: list[Node], out: Any) -> tuple[np.dtype[Any], tuple[int, ...]] | None:
        """Computes the cone's last tensor a slice of rows at a time, writing each slice; None
        (nothing written) when it cannot be computed so (then: whole)."""
        leaves = {i for n in cone for i in n.inputs if i not in self.producer}
        big = {t: self.tensors[t] for t in leaves if self.tensors[t].nbytes >= CHUNK_BYTES}
        if not big:
            return None
        rows = {t.dims[0] for t in big.values() if t.dims}
        if len(rows) != 1 or any(not t.dims for t in big.values()):
            return None
        total = rows.pop()
        step = max(1, CHUNK_BYTES // max(t.nbytes // total for t in big.values()))
        small: dict[str, np.ndarray] = {}  # tensors computed without the big ones, once
        start = out.tell()
        final: tuple[np.dtype[Any], tuple[int, ...]] | None = None
        written = 0
        for lo in range(0, total, step):
            hi = min(total, lo + step)
            part = self._slice(cone, big, small, lo, hi, total)
            if part is None:
                return None
            result, shape = part
            if final is None:
                final = result.dtype, shape
                _bounded(cone[-1].outputs[0], math.prod(shape) * result.dtype.itemsize, self.limit)
            elif final != (result.dtype, shape):
                return None
            written += out.write(memoryview(np.ascontiguousarray(result)).cast("B"))
        assert final is not None
        if written != int(np.prod(final[1])) * final[0].itemsize:
            out.seek(start)
            return None
        return final

    def _slice(self, cone: list[Node], big: dict[str, Tensor], small: dict[str, np.ndarray],
               lo: int, hi: int, total: int) -> tuple[np.ndarray, tuple[int, ...]] | None:
        """Rows lo..hi of the cone's last tensor, and the whole tensor's shape; None when a
        node does not work row by row."""
        rows: dict[str, tuple[np.ndarray, int]] = {t: (b.load_rows(self.folder, lo, hi), total)
                                                  for t, b in big.items()}  # -> (slice, its full rows)
        for k, n in enumerate(cone):
            name = n.outputs[0]
            if name in small:
                continue
            if not any(i in rows for i in n.inputs):
                small[name] = _apply(n, [small[i] if i in small else self.tensors[i].load(self.folder)
                                         for i in n.inputs], self.limit)
                continue
            args = [rows[i][0] if i in rows else small[i] if i in small
                    else self.tensors[i].load(self.folder) for i in n.inputs]
            fulls = {rows[i][1] for i in n.inputs if i in rows}
            if len(fulls) != 1:  # (slices of tensors of different lengths: rows do not match)
                return None
            full = fulls.pop()
            if k == len(cone) - 1 and n.op == "Reshape" and (args[1] > 0).all():
                shape = tuple(int(v) for v in args[1])  # (the result's shape: its bytes as they come)
                return args[0], shape
            done = _row_wise(n, args, [i in rows for i in n.inputs], full, self.limit)
            if done is None:
                return None
            rows[name] = done
            for i in n.inputs:  # (each slice is read once: the cone is a chain of them)
                if i in rows and i != name and not any(i in m.inputs for m in cone[k + 1:]):
                    del rows[i]
        last = cone[-1].outputs[0]
        if last not in rows:
            return None
        result, full = rows[last]
        return result, (full, *result.shape[1:])


def _row_wise(n: Node, args: list[np.ndarray], sliced: list[bool],
              full: int, limit: int) -> tuple[np.ndarray, int] | None:
    """The node on slices of rows (`sliced`: which inputs are; `full`: their whole length):
    (its result's slice, the result's whole length), or None when the node mixes rows."""
    x = args[0]
    if n.op in ("Cast", "Mul", "Add", "BitShift"):
        rank = max(a.ndim for a in args)
        for a, s in zip(args, sliced, strict=True):
            if s and a.ndim != rank:
                return None
            if not s and a.ndim == rank and a.shape[0] != 1:
                return None
        return _apply(n, args, limit), full
    if not sliced[0] or (any(sliced[1:]) and n.op != "Concat"):
        return None
    if n.op in ("Gather", "Concat"):
        axis = int(n.attrs.get("axis", 0))
        if axis % x.ndim == 0 or (n.op == "Concat" and not all(sliced)):
            return None
        return _apply(n, args, limit), full
    if n.op == "Unsqueeze":
        rank = x.ndim + len(args[1])
        if any(int(v) % rank == 0 for v in args[1].tolist()):
            return None
        return _unsqueeze(x, args[1]), full
    if n.op == "Reshape":
        target = [int(v) for v in args[1].tolist()]
        inner = int(np.prod(x.shape[1:]))
        if target and target[0] in (full, 0):
            target[0] = -1
        if not target or target[0] != -1 or any(d <= 0 for d in target[1:]):
            return None
        out_inner = int(np.prod(target[1:]))
        if (full * inner) % out_inner or (x.shape[0] * inner) % out_inner:
            return None
        return x.reshape([-1, *target[1:]]), full * inner // out_inner
    return None


def fold(model: bytes, folder: Path, spill: Path | None = None) -> Folded:
    """The model with its constant subgraphs folded (see the module's note); `spill` is where
    the folded tensors' file goes (default: `folder`, else the temporary folder)."""
    import onnxruntime as ort

    try:
        graph, nodes, inits, outputs = _parse(model)
    except (ValueError, UnicodeDecodeError, KeyError, IndexError) as exc:
        raise ModelFileError(f"not a valid ONNX model: {exc}") from exc
    tensors = {t.name: t for t in inits if t is not None}
    placeholder = next((t.location for t in tensors.values() if t.location), "")
    const = set(tensors)
    folded: list[int] = []
    for k, n in enumerate(nodes):
        if (n.op in RULES and n.domain in ("", "ai.onnx") and n.inputs and len(n.outputs) == 1
                and all(i in const for i in n.inputs)):
            folded.append(k)
            const.add(n.outputs[0])
    if not folded or not placeholder:
        return Folded(model, [], [], None)
    done = set(folded)
    read_later = {i for k, n in enumerate(nodes) if k not in done for i in n.inputs} | outputs
    run = _Evaluator(nodes, folded, tensors, folder)
    where: dict[str, tuple[int, np.dtype[Any], tuple[int, ...]]] = {}
    out = tempfile.TemporaryFile(dir=_writable(spill or folder))
    try:
        for name in (nodes[k].outputs[0] for k in folded):
            if name in read_later:
                pos = out.seek(0, os.SEEK_END)
                pos += out.write(b"\0" * (-pos % ALIGN))
                where[name] = run.write(name, out, pos)
        out.flush()
        size = out.seek(0, os.SEEK_END)
        mapping = (mmap.mmap(out.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
                   if size else None)
    finally:
        out.close()  # (the mapping keeps the unlinked file's pages)
    names = list(where)
    ort_values = []
    for name in names:
        pos, dtype, shape = where[name]
        count = int(np.prod(shape)) if shape else 1
        buf = (np.frombuffer(mapping, dtype, count, pos).reshape(shape) if count and mapping
               else np.zeros(shape, dtype))
        ort_values.append(ort.OrtValue.ortvalue_from_numpy(buf))
    kept = _rewrite(model, graph, inits, done, read_later, where, placeholder)
    log.debug("folded %d nodes into %d tensors (%.1f MiB)", len(done), len(names),
              (mapping.size() if mapping else 0) / 2**20)
    spans = {name: (where[name][0], int(np.prod(where[name][2])) * np.dtype(where[name][1]).itemsize)
             for name in names}
    return Folded(kept, names, ort_values, mapping, spans)


def _writable(folder: Path) -> Path | None:
    return folder if os.access(folder, os.W_OK) else None


def _parse(model: bytes) -> tuple[bytes, list[Node], list[Tensor | None], set[str]]:
    """The graph's bytes, its nodes, its initializers (None: one left to onnxruntime) in order,
    and its outputs' names."""
    graph = b""
    for number, _, value in fields(model):
        if number == MODEL_GRAPH:
            graph = bytes(value)  # type: ignore[arg-type]
    nodes, inits, outputs = [], [], set()
    for number, _, value in fields(graph):
        if number == GRAPH_NODE:
            nodes.append(_node(bytes(value)))  # type: ignore[arg-type]
        elif number == GRAPH_INIT:
            inits.append(tensor(bytes(value)))  # type: ignore[arg-type]
        elif number == GRAPH_OUTPUT:
            outputs.add(value_name(bytes(value)))  # type: ignore[arg-type]
    return graph, nodes, inits, outputs


def _declare(name: str, dtype: np.dtype[Any], shape: tuple[int, ...], location: str) -> bytes:
    nbytes = int(np.prod(shape)) * dtype.itemsize if shape else dtype.itemsize
    ext = [encode([(1, 2, k.encode()), (2, 2, v.encode())])
           for k, v in (("location", location), ("offset", "0"), ("length", str(nbytes)))]
    items: list[Field] = [*((TENSOR_DIMS, 0, d) for d in shape), (TENSOR_TYPE, 0, CODES[dtype]),
                          (TENSOR_NAME, 2, name.encode()), *((TENSOR_EXTERNAL, 2, e) for e in ext),
                          (TENSOR_LOCATION, 0, EXTERNAL)]
    return encode(items)


def _rewrite(model: bytes, graph: bytes, inits: list[Tensor | None], done: set[int],
             read_later: set[str], where: dict[str, tuple[int, np.dtype[Any], tuple[int, ...]]],
             placeholder: str) -> bytes:
    """The graph without the folded nodes and the initializers only they read (`inits`: as
    _parse found them, in order), declaring the folded tensors instead."""
    out: list[Field] = []
    k = i = 0
    for number, wire, value in fields(graph):
        if number == GRAPH_NODE:
            k += 1
            if k - 1 in done:
                continue
        elif number == GRAPH_INIT:
            t, i = inits[i], i + 1
            if t is not None and t.name not in read_later:
                continue  # (read only by folded nodes)
        out.append((number, wire, value))
    out += [(GRAPH_INIT, 2, _declare(name, dt, shape, placeholder))
            for name, (_, dt, shape) in where.items()]
    return encode([(number, wire, encode(out) if number == MODEL_GRAPH else value)
                   for number, wire, value in fields(model)])
