"""Graph admission: a graph a node (or the library) loads must be of the shapes edgelite's
exporter writes, checked before any other pass and before onnxruntime sees it. A pushed model
is data the node checks, not code it trusts:

- only the operators the exporter emits, in their domains (no `Loop`, `If`, `Scan` or any
  other control flow, no custom operator but the ones the exporter uses; edgelite's own are
  added by the later passes, never taken from a file);
- GroupQueryAttention's heads are the manifest's (`num_heads`, `kv_num_heads`);
- MatMulNBits' sizes are bounded and agree with its weights: `bits` 2, 4 or 8, `block_size`
  16 to 256, `K` a multiple of it, `K` and `N` at most MAX_DIM, and codes that are an
  initializer have exactly (N, K / block_size, block_size x bits / 8) elements, so a product
  allocates no more than its file holds;
- initializers as the exporter stores them: raw bytes, inline only up to INLINE_BYTES (every
  weight is external data), so a graph file cannot carry weights the manifest does not count;
- a node computed from constants alone is one engine/fold.py computes (and bounds: a folded
  result holds at most FOLD_GROWTH times what it is computed from), never left to
  onnxruntime's own folding at load, whose memory nothing bounds.

Anything else is refused with one line naming the node and what is wrong.
"""

from __future__ import annotations

import math

from edgelite.engine.fold import RULES, tensor
from edgelite.engine.onnxgraph import (
    GRAPH_INIT,
    GRAPH_NODE,
    NODE_DOMAIN,
    NODE_NAME,
    Field,
    fields,
    node_attrs,
    node_parts,
)
from edgelite.engine.passes.base import Graph, Pass
from edgelite.manifest import MAX_DIM, Manifest

MS = "com.microsoft"
# (domain, operator) the exporter writes (exporter/graph.py)
ALLOWED = frozenset({
    *(("", op) for op in ("Add", "Mul", "Reshape", "Transpose", "MatMul", "Gather", "Cast", "Unsqueeze",
                          "Split", "Sigmoid", "ReduceSum", "Identity", "Concat", "BitShift",
                          "SimplifiedLayerNormalization")),
    *((MS, op) for op in ("MatMulNBits", "GroupQueryAttention", "GatherBlockQuantized", "FastGelu",
                          "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization")),
})
BITS = (2, 4, 8)
BLOCKS = (16, 32, 64, 128, 256)
INLINE_BYTES = 64  # an initializer held in the graph itself at most (exporter/graph.py's rule)


def admit_pass(m: Manifest) -> Pass:
    """The pass that refuses a graph edgelite's exporter would not write (changes nothing)."""
    return Pass("admit", lambda graph: _admit(graph, m), "the graph is not one edgelite's exporter writes")


def _admit(graph: Graph, m: Manifest) -> Graph:
    codes: dict[str, list[int]] = {}
    external = False
    for number, _, value in fields(graph):
        if number == GRAPH_INIT:
            t = tensor(value)  # type: ignore[arg-type]
            if t is None:
                raise ValueError("an initializer is stored in a form the exporter does not write "
                                 "(typed value lists, or external data without a location)")
            if any(d < 0 for d in t.dims) or (
                    not t.location and math.prod(t.dims) * t.dtype.itemsize > INLINE_BYTES):
                raise ValueError(f"initializer {t.name[:80]!r} of dims {t.dims[:8]} is held in the graph "
                                 f"(the exporter holds at most {INLINE_BYTES} bytes there)")
            codes[t.name] = t.dims
            external |= bool(t.location)
    for number, _, value in fields(graph):
        if number != GRAPH_NODE:
            continue
        op, inputs, _, rest = node_parts(value)  # type: ignore[arg-type]
        domain, name = _domain_name(rest)
        if (domain, op) not in ALLOWED:
            raise ValueError(f"node {name!r}: operator {domain + ':' if domain else ''}{op[:60]} is not one "
                             f"the exporter writes (control flow and other custom operators are refused)")
        attrs = node_attrs(rest)
        if op == "GroupQueryAttention":
            for attr, want in (("num_heads", m.num_heads), ("kv_num_heads", m.num_kv_heads)):
                if attrs.get(attr) != want:
                    raise ValueError(f"node {name!r}: {attr} is {attrs.get(attr)}, the manifest says {want}")
        elif op == "MatMulNBits":
            _product(name, attrs, inputs, codes)
    _constants(graph, set(codes), external)
    return graph


def _domain_name(rest: list[Field]) -> tuple[str, str]:
    """A node's domain ("" for ONNX's) and its name (shortened for a message)."""
    domain = next((bytes(v).decode() for n, _, v in rest if n == NODE_DOMAIN), "")  # type: ignore[arg-type]
    name = next((bytes(v).decode() for n, _, v in rest if n == NODE_NAME), "?")[:120]  # type: ignore[arg-type]
    return domain, name


def _constants(graph: Graph, const: set[str], external: bool) -> None:
    """Every node computed from constants alone is one fold.py computes, in a graph with
    external weights (fold.py folds only there; else onnxruntime would)."""
    for number, _, value in fields(graph):
        if number != GRAPH_NODE:
            continue
        op, inputs, outputs, rest = node_parts(value)  # type: ignore[arg-type]
        real = [i for i in inputs if i]
        if not real or not all(i in const for i in real):
            continue
        domain, name = _domain_name(rest)
        if domain not in ("", "ai.onnx") or op not in RULES or not external:
            raise ValueError(f"node {name!r}: {op[:60]} is computed from constants alone, which the exporter "
                             f"writes only for {', '.join(sorted(RULES))} over external weights")
        const.update(outputs)


def _product(name: str, attrs: dict[str, int | float], inputs: list[str],
             codes: dict[str, list[int]]) -> None:
    k, n, bits, block = (int(attrs.get(a, 0)) for a in ("K", "N", "bits", "block_size"))
    if bits not in BITS or block not in BLOCKS or not 0 < k <= MAX_DIM or not 0 < n <= MAX_DIM or k % block:
        raise ValueError(f"node {name!r}: MatMulNBits K={k} N={n} bits={bits} block_size={block} is "
                         f"outside what the exporter writes")
    dims = codes.get(inputs[1]) if len(inputs) > 1 else None
    if dims is not None and dims != [n, k // block, block * bits // 8]:
        raise ValueError(f"node {name!r}: MatMulNBits K={k} N={n} needs codes of shape "
                         f"{[n, k // block, block * bits // 8]}, its initializer is {dims[:8]}")
