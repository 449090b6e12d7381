"""Products with narrow weights by edgelite's own operators (engine/kernels), in place of onnxruntime's
MatMulNBits, rewritten as a range (or the head) loads: no re-export. Which product is which
kind, and which of the graph's tensors hold its parts, the manifest says (`FileEntry.products`,
written by the exporter: this module knows no exporter tensor name); each part's dtype and
shape are checked here before it is used, and a product that fails stays MatMulNBits.

- A fast export's 4-bit products in blocks of 32 (`q4`: MatMulNBits, bits 4, block_size 32,
  accuracy_level 4, no zero points: the exporter centres them at 8) become MatMul4: the
  export's codes and scales, interleaved four columns at a time (Reshape, Concat padding the
  blocks to a multiple of 4 with zeros, Transpose). onnxruntime then holds 4 bits and a float
  scale per 32 weights where MatMulNBits packs them again at about 6.
- Its Q4_K products (`q4_k`: the same 4-bit MatMulNBits, whose scales are a float16 per 256
  weights, `scale_base`, times a byte per block, `scale_mult`, with the separate minima
  product the exporter adds to it: x's block sums by the block's minimum, `min_base` times
  `min_mult` times `min_factor` (1 or -1), plus 8 times its scale) become one MatMul4K: the
  codes as MatMul4 takes them, each block's two bytes (a super-block's scale multiples of the
  four columns, then their minimum multiples) and each super-block's two float16s. 4.625 bits
  a weight where MatMul4 and the float minima product read about 6, and three fewer operators
  a product.
- Its large 8-bit products in blocks of 32 (`q8`: at least EIGHT_FROM weights: the int4
  exports' 8-bit head, a big model's Q8_0 products) become MatMul8 on the same codes and
  scales, interleaved the same way; rows of a chunk (a prompt, a speculative step's positions)
  share each column's codes. Smaller ones stay in the caches, where MatMulNBits' kernel is the
  faster.
- Its Q6_K products (`q6_k`: MatMulNBits bits 8, block_size 16, accuracy_level 4, whose codes
  the export stores at 6 bits, `stream`, with the constant `low` added, and whose scales are a
  float16 per 256 weights times a signed byte per block) become MatMul6 on that stream and
  those scales, interleaved the same way: 6.56 bits a weight where MatMulNBits holds about 12.

The interleaving nodes work on initializers only, so engine/fold.py computes them before
onnxruntime sees the graph (into its mapping: no copy), and a decode step reads each
product's bytes as one stream. Only the kinds whose operators have their vector path in the
library (`kernels.matmul_kinds`: all four with AVX-512 VNNI and VBMI and on ARM, MatMul4 and
MatMul8 with AVX2; a Q4_K product then goes to MatMul4 beside its minima product); elsewhere
onnxruntime's own kernels are faster, and the graph is left as it is. Any other product
(exact mode, other widths, zero points, one the manifest does not list) stays MatMulNBits.
What the rewrite leaves unread (a replaced product's minima, block sums no product reads any
more) is dropped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from edgelite.config import RuntimeConfig
from edgelite.engine import kernels
from edgelite.engine.fold import Tensor, tensor
from edgelite.engine.kernels.twins import ZERO8
from edgelite.engine.onnxgraph import (
    FLOAT,
    FLOAT16,
    GRAPH_INIT,
    GRAPH_NODE,
    GRAPH_OUTPUT,
    INT64,
    TENSOR_DIMS,
    TENSOR_NAME,
    TENSOR_RAW,
    TENSOR_TYPE,
    UINT8,
    Field,
    each_node,
    encode,
    fields,
    make_node,
    make_tensor,
    node_attrs,
    node_parts,
    value_name,
)
from edgelite.engine.passes.base import Pass, apply
from edgelite.manifest import FileEntry, Manifest, Product

BLOCK = 32  # the weights a block (one scale) MatMul4 takes
GROUP = 4  # columns interleaved together
STEP = 4  # blocks a column's 64 bytes hold
SUPER = 256  # MatMul6: the weights a super-block (one float16 base scale)
BLOCK6 = 16  # MatMul6: the weights a block (one signed byte of scale)
UNIT8 = 64  # MatMul8: the weights of a column it reads at a time (K a multiple)
# weights from which MatMul8 beats MatMulNBits' 8-bit kernel (bench_matmul, 1 thread: 576 x 1536,
# in the caches, 0.85-0.9x; 576 x 49,152, a head, 1.18x for 1 row and 1.45x for 4; 2048 x 8192
# 1.0-1.3x)
EIGHT_FROM = 1 << 22
KIND_OPS = {"q4": "MatMul4", "q4_k": "MatMul4K", "q6_k": "MatMul6", "q8": "MatMul8"}  # kind -> its operator
_UNLISTED: set[str] = set()  # exports said to list no products (once each)
log = logging.getLogger(__name__)
P = "edgelite_mm"  # names of what the rewrite adds
RESIDENT = (f"{P}/",)  # its folded weights, read in place at every step (session.open_model)


def library(cfg: RuntimeConfig) -> Path | None:
    """The kernel library whose products a session should use: where `matmul_kernel` is on
    and the build has a vector path for some of them; else None (MatMulNBits stays)."""
    if not cfg.matmul_kernel:
        return None
    found = kernels.library(cfg)
    return found if found is not None and kernels.matmul_kinds(found) else None


def listed(entries: Iterable[FileEntry], what: str) -> list[Product]:
    """The products the manifest lists for these graphs (an export made before it listed them
    has its products run by onnxruntime, which is said once)."""
    entries = list(entries)
    if any(e.products is None for e in entries) and what not in _UNLISTED:
        _UNLISTED.add(what)
        log.warning("%s: the export does not list its products' kinds (made before they were "
                    "listed): they stay onnxruntime's MatMulNBits, which holds more memory; run "
                    "`edgelite-export upgrade DIR` on the export (or export it again)", what)
    return [p for e in entries for p in (e.products or ())]


def narrow(cfg: RuntimeConfig, manifest: Manifest) -> bool:
    """Whether this device holds the model's layers as the export stores them: the library
    runs every product kind its layers list (the planner's `narrow`, and what this module then
    does: one capability set, kernels.matmul_kinds). A device with some of the kinds (AVX2: q4
    and q8) still runs those, and holds less than it is counted for."""
    found = library(cfg)
    kinds = {p.kind for e in manifest.layers for p in (e.products or ())}
    return found is not None and bool(kinds) and {KIND_OPS[k] for k in kinds} <= kernels.matmul_kinds(found)


def products_pass(listed: Iterable[Product], threads: int = 1,
                  kinds: frozenset[str] = frozenset(kernels.MATMUL_OPS)) -> Pass:
    """The pass that makes each eligible product of `listed` (the manifest's: see the module's
    text) a MatMul4, MatMul4K, MatMul6 or MatMul8 node, of `kinds` (the library's vector paths:
    kernels.matmul_kinds; the session must register engine/kernels' library)."""
    rewrite = _Rewrite(threads, kinds, {p.node: p for p in listed})
    return Pass("products", rewrite.graph, "cannot rewrite the graph's products", ours=True)


def products(model: bytes, listed: Iterable[Product], threads: int = 1,
             kinds: frozenset[str] = frozenset(kernels.MATMUL_OPS)) -> bytes:
    """The model with `products_pass` run over it."""
    return apply(model, [products_pass(listed, threads, kinds)])


def _shape(attrs: dict[str, int | float], inputs: list[str], bits: int, block: int, k_multiple: int) -> bool:
    """A MatMulNBits of `bits` in blocks of `block` at accuracy level 4, no zero points, bias
    or group index, K a multiple of `k_multiple` and N of the group."""
    k, n = int(attrs.get("K", 0)), int(attrs.get("N", 0))
    return (attrs.get("bits") == bits and attrs.get("block_size") == block
            and attrs.get("accuracy_level") == 4 and len(inputs) == 3 and all(inputs)
            and k > 0 and k % k_multiple == 0 and n > 0 and n % GROUP == 0)


class _Rewrite:
    def __init__(self, threads: int, kinds: frozenset[str], listed: dict[str, Product]) -> None:
        self.threads, self.kinds, self.listed = threads, kinds, listed
        self.count = 0
        self.consts: dict[str, Field] = {}

    def graph(self, graph: bytes) -> bytes:
        inits: dict[str, Tensor] = {}
        for number, _, value in fields(graph):
            if number == GRAPH_INIT:
                t = tensor(value)  # type: ignore[arg-type]
                if t is not None:
                    inits[t.name] = t
        nodes = {outputs[0]: (op, inputs, outputs) for number, _, value in fields(graph)
                 if number == GRAPH_NODE for op, inputs, outputs, _ in [node_parts(value)]  # type: ignore[arg-type]
                 if outputs}
        items: list[Field] = []
        replaced: set[str] = set()  # outputs of the minima nodes a MatMul4K replaces
        for field, node in each_node(graph, "MatMulNBits"):
            if node is None:
                if field[0] != GRAPH_NODE or not set(node_parts(field[2])[2]) & replaced:  # type: ignore[arg-type]
                    items.append(field)
                continue
            inputs, outputs, rest = node
            attrs = node_attrs(rest)
            k, n = int(attrs.get("K", 0)), int(attrs.get("N", 0))
            product = self.listed.get(outputs[0]) if outputs else None
            kind = product.kind if product is not None else ""
            new = None
            if kind in ("q4", "q4_k") and _shape(attrs, inputs, 4, BLOCK, BLOCK):
                # (a Q4_K's whole, else its codes and scales beside its minima product)
                if kind == "q4_k" and k % SUPER == 0 and "MatMul4K" in self.kinds:
                    assert product is not None
                    new = self._four_k(self.count + 1, inputs, outputs[0], k, n, inits, nodes,
                                       product.parts, replaced)
                if new is None and "MatMul4" in self.kinds:
                    new = self._four(self.count + 1, inputs, outputs[0], k, n)
            elif kind == "q6_k" and _shape(attrs, inputs, 8, BLOCK6, SUPER) and "MatMul6" in self.kinds:
                assert product is not None
                new = self._six(self.count + 1, inputs, outputs[0], k, n, inits, product.parts)
            elif (kind == "q8" and _shape(attrs, inputs, 8, BLOCK, UNIT8) and k * n >= EIGHT_FROM
                  and "MatMul8" in self.kinds):
                new = self._eight(self.count + 1, inputs, outputs[0], k, n)
            if new is None:
                items.append(field)
                continue
            self.count += 1
            items += new
        return encode(_read([*items, *self.consts.values()])) if self.count else graph

    def _ints(self, *values: int) -> str:
        name = f"{P}/c/i" + "_".join(str(v) for v in values)
        if name not in self.consts:
            self.consts[name] = (GRAPH_INIT, 2, make_tensor(name, INT64, list(values), [len(values)]))
        return name

    def _zeros(self, elem: int, dims: list[int]) -> str:
        """A constant of zeros (float32 or uint8)."""
        name = f"{P}/c/z{elem}_" + "_".join(str(d) for d in dims)
        if name not in self.consts:
            size = math.prod(dims) * (4 if elem == FLOAT else 1)
            proto = encode([*((TENSOR_DIMS, 0, d) for d in dims), (TENSOR_TYPE, 0, elem),
                            (TENSOR_NAME, 2, name.encode()), (TENSOR_RAW, 2, bytes(size))])
            self.consts[name] = (GRAPH_INIT, 2, proto)
        return name

    def _four(self, i: int, inputs: list[str], out: str, k: int, n: int) -> list[Field]:
        """The nodes of one MatMul4 and its interleaved weights (what engine/fold.py computes)."""
        a, codes, scales = inputs
        blocks = k // BLOCK
        padded = -(-blocks // STEP) * STEP
        t = f"{P}/{i}"
        nodes: list[Field] = []
        add = _adder(nodes)

        c = add("Reshape", [codes, self._ints(n, blocks, 16)], f"{t}/codes")
        s = add("Reshape", [scales, self._ints(n, blocks)], f"{t}/scales")
        if padded > blocks:
            c = add("Concat", [c, self._zeros(UINT8, [n, padded - blocks, 16])], f"{t}/codes_padded", axis=1)
            s = add("Concat", [s, self._zeros(FLOAT, [n, padded - blocks])], f"{t}/scales_padded", axis=1)
        c = add("Reshape", [c, self._ints(n // GROUP, GROUP, padded // STEP, 64)], f"{t}/codes_grouped")
        s = add("Reshape", [s, self._ints(n // GROUP, GROUP, padded // STEP, STEP)], f"{t}/scales_grouped")
        c = add("Transpose", [c], f"{t}/codes4", perm=[0, 2, 1, 3])
        s = add("Transpose", [s], f"{t}/scales4", perm=[0, 2, 1, 3])
        nodes.append((GRAPH_NODE, 2, make_node("MatMul4", [a, c, s], [out], f"{t}/MatMul4", kernels.DOMAIN,
                                               K=k, N=n, threads=self.threads)))
        return nodes

    def _eight(self, i: int, inputs: list[str], out: str, k: int, n: int) -> list[Field]:
        """The nodes of one MatMul8 (an 8-bit product in blocks of 32: Q8_0, a fast head)."""
        a, codes, scales = inputs
        t = f"{P}/{i}"
        nodes: list[Field] = []
        add = _adder(nodes)
        c = add("Reshape", [codes, self._ints(n // GROUP, GROUP, k // UNIT8, UNIT8)], f"{t}/codes_grouped")
        c = add("Transpose", [c], f"{t}/codes8", perm=[0, 2, 1, 3])
        shape = self._ints(n // GROUP, GROUP, k // UNIT8, UNIT8 // BLOCK)
        s = add("Reshape", [scales, shape], f"{t}/scales_grouped")
        s = add("Transpose", [s], f"{t}/scales8", perm=[0, 2, 1, 3])
        nodes.append((GRAPH_NODE, 2, make_node("MatMul8", [a, c, s], [out], f"{t}/MatMul8", kernels.DOMAIN,
                                               K=k, N=n, zero=ZERO8, threads=self.threads)))
        return nodes

    def _four_k(self, i: int, inputs: list[str], out: str, k: int, n: int, inits: dict[str, Tensor],
                nodes: dict[str, tuple[str, list[str], list[str]]], parts: dict[str, str],
                replaced: set[str]) -> list[Field] | None:
        """The nodes of one MatMul4K on a Q4_K product's codes, scales and minima (None when its
        parts are not what a Q4_K product's are); the minima product and the Add it replaces go
        into `replaced`."""
        a, codes, _ = inputs
        total, other = parts["output"], parts["minima"]
        summed, product = nodes.get(total), nodes.get(other)
        supers = k // SUPER
        d, sc = inits.get(parts["scale_base"]), inits.get(parts["scale_mult"])
        e, m = inits.get(parts["min_base"]), inits.get(parts["min_mult"])
        factor = inits.get(parts["min_factor"]) if "min_factor" in parts else None
        if (summed is None or summed[0] != "Add" or sorted(summed[1]) != sorted([out, other])
                or product is None or product[0] != "MatMul"
                or any(t is None or t.dtype != np.float16 or t.dims != [n, supers] for t in (d, e))
                or any(t is None or t.dtype != np.uint8 or t.dims != [n, k // BLOCK] for t in (sc, m))
                or ("min_factor" in parts and _scalar(factor, None) not in (1.0, -1.0))):
            return None
        assert d is not None and e is not None and sc is not None and m is not None
        replaced.update([other, total])
        t = f"{P}/{i}"
        nodes_out: list[Field] = []
        add = _adder(nodes_out)
        c = add("Reshape", [codes, self._ints(n // GROUP, GROUP, 2 * supers, 64)], f"{t}/codes_grouped")
        c = add("Transpose", [c], f"{t}/codes4", perm=[0, 2, 1, 3])
        halves = [add("Transpose", [add("Reshape", [x.name, self._ints(n // GROUP, GROUP, supers, 1, 8)],
                                        f"{t}/{label}")], f"{t}/{label}_t", perm=[0, 2, 3, 1, 4])
                  for x, label in ((sc, "scale_mult"), (m, "min_mult"))]
        mult = add("Concat", halves, f"{t}/mult4k", axis=2)
        e_half = e.name
        if factor is not None:  # (a power of two: exact in float16)
            e_f = add("Mul", [add("Cast", [e.name], f"{t}/e", to=FLOAT), factor.name], f"{t}/e_signed")
            e_half = add("Cast", [e_f], f"{t}/e_half", to=FLOAT16)
        shape = self._ints(n // GROUP, GROUP, supers)
        grouped = [add("Reshape", [x, shape], f"{t}/{label}_grouped")
                   for x, label in ((d.name, "d"), (e_half, "e"))]
        base = add("Concat", grouped, f"{t}/base", axis=1)
        base = add("Transpose", [base], f"{t}/base4k", perm=[0, 2, 1])
        nodes_out.append((GRAPH_NODE, 2, make_node("MatMul4K", [a, c, mult, base], [total], f"{t}/MatMul4K",
                                                   kernels.DOMAIN, K=k, N=n, threads=self.threads)))
        return nodes_out

    def _six(self, i: int, inputs: list[str], out: str, k: int, n: int,
             inits: dict[str, Tensor], parts: dict[str, str]) -> list[Field] | None:
        """The nodes of one MatMul6 on a Q6_K product's stored stream and scales (None when its
        parts are not what a Q6_K product's are)."""
        a = inputs[0]
        stream, low = inits.get(parts["stream"]), inits.get(parts["low"])
        base, mult = inits.get(parts["scale_base"]), inits.get(parts["scale_mult"])
        supers = k // SUPER
        if (stream is None or low is None or base is None or mult is None
                or stream.dtype != np.uint8 or stream.dims != [n * k // 8, 6]
                or low.dtype != np.uint8 or low.dims not in ([], [1]) or low.location
                or base.dtype != np.float16 or base.dims != [n, supers]
                or mult.dtype != np.int8 or mult.dims != [n, k // BLOCK6]):
            return None
        zero = 128 - int(low.load(Path(".")).reshape(-1)[0])
        t = f"{P}/{i}"
        nodes: list[Field] = []
        add = _adder(nodes)
        c = add("Reshape", [stream.name, self._ints(n // GROUP, GROUP, supers, 192)], f"{t}/codes_grouped")
        c = add("Transpose", [c], f"{t}/codes6", perm=[0, 2, 1, 3])
        m = add("Reshape", [mult.name, self._ints(n // GROUP, GROUP, supers, 16)], f"{t}/mult_grouped")
        m = add("Transpose", [m], f"{t}/mult6", perm=[0, 2, 1, 3])
        b = add("Cast", [base.name], f"{t}/base", to=FLOAT)
        b = add("Reshape", [b, self._ints(n // GROUP, GROUP, supers)], f"{t}/base_grouped")
        b = add("Transpose", [b], f"{t}/base6", perm=[0, 2, 1])
        nodes.append((GRAPH_NODE, 2, make_node("MatMul6", [a, c, m, b], [out], f"{t}/MatMul6", kernels.DOMAIN,
                                               K=k, N=n, zero=zero, threads=self.threads)))
        return nodes


def _scalar(t: Tensor | None, want: float | None) -> float | None:
    """An in-file float32 scalar's value (None when it is not one, or not `want`)."""
    if t is None or t.dtype != np.float32 or t.dims not in ([], [1]) or t.location:
        return None
    value = float(t.load(Path(".")).reshape(-1)[0])
    return value if want is None or value == want else None


def _read(items: list[Field]) -> list[Field]:
    """A graph's fields without the nodes and initializers nothing reads (repeatedly: a node
    read only by dropped ones goes too)."""
    outputs = {value_name(v) for number, _, v in items if number == GRAPH_OUTPUT}  # type: ignore[arg-type]
    parts = {i: node_parts(v) for i, (number, _, v) in enumerate(items) if number == GRAPH_NODE}  # type: ignore[arg-type]
    while True:
        read = outputs | {x for _, ins, _, _ in parts.values() for x in ins}
        dead = [i for i, (_, _, outs, _) in parts.items() if not set(outs) & read]
        if not dead:
            break
        for i in dead:
            del parts[i]
    keep = []
    for i, (number, wire, value) in enumerate(items):
        if number == GRAPH_NODE and i not in parts:
            continue
        if number == GRAPH_INIT:
            t = tensor(value)  # type: ignore[arg-type]
            if t is not None and t.name not in read:
                continue
        keep.append((number, wire, value))
    return keep


def _adder(nodes: list[Field]) -> Callable[..., str]:
    """add(op, inputs, name, **attributes): appends a node whose one output is `name`."""

    def add(op: str, ins: list[str], name: str, **attrs: int | list[int]) -> str:
        nodes.append((GRAPH_NODE, 2, make_node(op, ins, [name], name, **attrs)))
        return name
    return add
