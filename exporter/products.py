"""Each product's kind, for the manifest: which MatMulNBits of a graph is a Q4_0-like 4-bit
product, a Q4_K product (with its minima product), a Q6_K product or an 8-bit one, and which
of the graph's tensors hold its parts. The node reads these (edgelite/engine/passes/linear.py) to run
the products by its own operators; it never rebuilds this exporter's tensor names.

The names are graph.py's (`Linears`): a product `<name>/MatMulNBits` on `<name>.qweight` and
`<name>.scales`; a Q4_K scale is `<name>.scales.base_fp16` (a float16 per 256 weights) times
`<name>.scales.mult` (a byte per block), its minima product `x's block sums x <name>.minima`
added to it, the minima being `<name>.minima.base.*` (times `factor`) plus `shift` times the
scales; a Q6_K's codes are stored at 6 bits, `<B>.6bit`, with `<B>.low` added.

`products_of` reads a written graph; `upgrade` adds the table to an export made before
product kinds (`edgelite-export upgrade DIR`: its files are unchanged, only the manifest).
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import onnx
from onnx import numpy_helper

from edgelite import manifest as mf

log = logging.getLogger(__name__)
BLOCK = 32
BLOCK6 = 16
SUPER = 256


def products_of(path: Path) -> tuple[mf.Product, ...]:
    """The products of the graph at `path` (its weights are not read)."""
    graph = onnx.load(str(path), load_external_data=False).graph
    inits = {t.name: t for t in graph.initializer}
    nodes = {n.output[0]: n for n in graph.node if n.output}
    found = []
    for node in graph.node:
        if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
            continue
        attrs = {a.name: a.i for a in node.attribute}
        inputs = list(node.input)
        if attrs.get("accuracy_level") != 4 or len(inputs) != 3 or not all(inputs):
            continue
        out = node.output[0]
        if attrs.get("bits") == 4 and attrs.get("block_size") == BLOCK:
            found.append(_four_k(out, inputs, inits, nodes) or mf.Product("q4", out))
        elif attrs.get("bits") == 8 and attrs.get("block_size") == BLOCK6:
            six = _six(out, inputs, inits)
            if six is not None:
                found.append(six)
        elif attrs.get("bits") == 8 and attrs.get("block_size") == BLOCK:
            found.append(mf.Product("q8", out))
    return tuple(found)


def _four_k(out: str, inputs: list[str], inits: dict[str, onnx.TensorProto],
            nodes: dict[str, onnx.NodeProto]) -> mf.Product | None:
    """A Q4_K product (its scales factored, its minima product added to it), or None."""
    a, _, scales = inputs
    name = out.removesuffix("/MatMulNBits/output_0")
    mins = f"{name}.minima"
    adds = [o for o, n in nodes.items() if n.op_type == "Add" and out in n.input]
    if name == out or scales != f"{name}.scales/Flatten/output_0" or len(adds) != 1:
        return None
    add_ins = list(nodes[adds[0]].input)
    other = add_ins[1] if add_ins[0] == out else add_ins[0]
    product, total = nodes.get(other), nodes.get(mins)
    shifted = nodes.get(f"{mins}/Mul/output_0")
    factor = f"{mins}.base.factor" if f"{mins}.base.factor" in inits else ""
    based = f"{mins}.base/factor/Mul/output_0" if factor else f"{mins}.base/Flatten/output_0"
    sums = f"{a}/block_sums{BLOCK}/ReduceSum/output_0"
    summed = nodes.get(total.input[0]) if total is not None and total.input else None
    if (product is None or product.op_type != "MatMul" or list(product.input) != [sums, mins]
            or total is None or total.op_type != "Transpose" or summed is None
            or summed.op_type != "Add" or sorted(summed.input) != sorted([based, f"{mins}/Mul/output_0"])
            or shifted is None or list(shifted.input) != [scales, f"{mins}.shift"]
            or f"{name}.scales.factor" in inits or _scalar(inits.get(f"{mins}.shift")) != 8.0):
        return None
    parts = {"output": adds[0], "minima": other, "scale_base": f"{name}.scales.base_fp16",
             "scale_mult": f"{name}.scales.mult", "min_base": f"{mins}.base.base_fp16",
             "min_mult": f"{mins}.base.mult"}
    if factor:
        parts["min_factor"] = factor
    if any(parts[k] not in inits for k in ("scale_base", "scale_mult", "min_base", "min_mult")):
        return None
    return mf.Product("q4_k", out, parts)


def _six(out: str, inputs: list[str], inits: dict[str, onnx.TensorProto]) -> mf.Product | None:
    """A Q6_K product (its codes stored at 6 bits, its scales factored), or None."""
    _, codes, scales = inputs
    tail = "/Flatten/output_0"
    if not scales.endswith(tail):
        return None
    parts = {"stream": f"{codes}.6bit", "low": f"{codes}.low",
             "scale_base": f"{scales[:-len(tail)]}.base_fp16", "scale_mult": f"{scales[:-len(tail)]}.mult"}
    return mf.Product("q6_k", out, parts) if all(v in inits for v in parts.values()) else None


def _scalar(t: onnx.TensorProto | None) -> float | None:
    if t is None or t.data_location == onnx.TensorProto.EXTERNAL:
        return None
    value = numpy_helper.to_array(t).reshape(-1)
    return float(value[0]) if value.size == 1 else None


def upgrade(model_dir: Path) -> int:
    """Add the product table to an export's manifest (one written before product kinds);
    the number of products found. The graphs and weights are not changed, so copies pushed to
    nodes stay valid: the manifest goes with each deployment."""
    m = mf.load(model_dir)
    if all(e.products is not None for e in (m.head, *m.layers)):
        log.info("%s already lists its products", model_dir)
        return sum(len(e.products or ()) for e in (m.head, *m.layers))

    def listed(e: mf.FileEntry) -> mf.FileEntry:
        return replace(e, products=products_of(model_dir / e.file))

    m = replace(m, embed=listed(m.embed), head=listed(m.head), layers=[listed(e) for e in m.layers])
    mf.parse(json.loads(json.dumps(m.to_json())), model_dir)  # (what a node will read)
    mf.write(m, model_dir)
    return sum(len(e.products or ()) for e in (m.head, *m.layers))
