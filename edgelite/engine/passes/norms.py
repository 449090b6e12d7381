"""RMS norms by edgelite's own operators (engine/kernels: Norm, SkipNorm), in place of
onnxruntime's SimplifiedLayerNormalization and SkipSimplifiedLayerNormalization, rewritten as a
range or the head loads.

onnxruntime's SimplifiedLayerNormalization gives other bits on its ARM build than on its x86
one (measured on 1.29.0: the same input, other roundings), so a layer range on a phone would
not give what the same range gives on a PC; the kernels' norms give the same bits on every ISA
(engine/kernels/src/norm.h), as its attention and products do. A norm is rewritten where its
scale is an initializer of d values, d a multiple of 8, over the last axis, without a bias, and
only the outputs the kernel gives are read (the normed rows; SkipNorm: and the sum); any other
stays onnxruntime's.
"""

from __future__ import annotations

import numpy as np

from edgelite.engine.fold import Tensor, tensor
from edgelite.engine.kernels import DOMAIN
from edgelite.engine.onnxgraph import (
    GRAPH_INIT,
    GRAPH_NODE,
    GRAPH_OUTPUT,
    Field,
    encode,
    fields,
    make_node,
    node_attrs,
    node_parts,
    value_name,
)
from edgelite.engine.passes.base import Pass, apply

LANES = 8  # the kernel's vector lanes: d must be a multiple
MAX_D = 1 << 16  # the largest d the kernel takes


def norms_pass() -> Pass:
    """The pass that makes each eligible norm (see the module's text) an edgelite Norm or
    SkipNorm (the session must register engine/kernels' library)."""
    return Pass("norms", _Rewrite().graph, "cannot rewrite the graph's norms", ours=True)


def norms(model: bytes) -> bytes:
    """The model with `norms_pass` run over it."""
    return apply(model, [norms_pass()])


class _Rewrite:
    def __init__(self) -> None:
        self.count = 0

    def graph(self, graph: bytes) -> bytes:
        inits: dict[str, Tensor] = {}
        read: set[str] = set()
        for number, _, value in fields(graph):
            if number == GRAPH_INIT:
                t = tensor(value)  # type: ignore[arg-type]
                if t is not None:
                    inits[t.name] = t
            elif number == GRAPH_NODE:
                read |= set(node_parts(value)[1])  # type: ignore[arg-type]
            elif number == GRAPH_OUTPUT:
                read.add(value_name(value))  # type: ignore[arg-type]
        items: list[Field] = []
        for number, wire, value in fields(graph):
            new = self._node(value, inits, read) if number == GRAPH_NODE else None  # type: ignore[arg-type]
            if new is None:
                items.append((number, wire, value))
            else:
                items.append((GRAPH_NODE, 2, new))
                self.count += 1
        return encode(items) if self.count else graph

    def _node(self, node: bytes, inits: dict[str, Tensor], read: set[str]) -> bytes | None:
        op, inputs, outputs, rest = node_parts(node)
        if op not in ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"):
            return None
        attrs = node_attrs(rest)
        skip = op.startswith("Skip")
        scale = inputs[2 if skip else 1] if len(inputs) > (2 if skip else 1) else ""
        t = inits.get(scale)
        if (t is None or t.dtype != np.float32 or len(t.dims) != 1 or not 0 < t.dims[0] <= MAX_D
                or t.dims[0] % LANES or int(attrs.get("axis", -1)) != -1 or len(inputs) > (3 if skip else 2)):
            return None
        used = [i for i, o in enumerate(outputs) if o and o in read]
        if any(i not in ((0, 3) if skip else (0,)) for i in used):
            return None  # (its mean or inverse deviation is read: the kernel does not give them)
        eps = float(attrs.get("epsilon", 1e-5))
        name = f"edgelite_norm/{outputs[0]}"
        if skip:
            return make_node("SkipNorm", [inputs[0], inputs[1], scale],
                             [outputs[0], outputs[3] if len(outputs) > 3 else ""], name, DOMAIN, epsilon=eps)
        return make_node("Norm", [inputs[0], scale], [outputs[0]], name, DOMAIN, epsilon=eps)
