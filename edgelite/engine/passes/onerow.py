"""Products whose one-row kernel is not their several-row one: one-row steps run them on two.

onnxruntime's MatMulNBits computes a single row (M = 1: a decode step) by other code than
several rows on some CPUs, with the sums in another order: on an AVX2 machine without
AVX-512 the same row came out up to 1.4e-6 apart, alone and in a step of two or more (where
it is the same for any number of rows, measured bit for bit). A speculative step's
verification, a prompt chunk, a batch of sessions then differ from decode steps a little, and
a near tie flips a greedy token: with prompt lookup, 7 of 8 open-chat replies of SmolLM2 left
the plain reply's ids. On a machine with AVX-512 VNNI the two agree.

`varies` asks onnxruntime once per process and per kind of product (bits, block size,
accuracy level) whether a row alone and the same row in a step of two differ; `pad_products`
then rewrites each such product of the fast exports' kind (PADDED_LEVELS) so that a step of
one row runs it on that row and a copy (Gather with the indices [0, 0]) and keeps the first
row of its result. Steps of several rows run as they are (indices 0..m-1). The price is a
two-row product in a one-row step: SmolLM2 int4 fast decoded at 0.81x (1 thread, AVX2,
onnxruntime's products). By default a fast export's products there are edgelite's (engine/kernels)
(row-invariant, and faster: engine/passes/linear.py), so this pays only for what stays MatMulNBits:
with --no-matmul-kernel, or a K-quant export's kinds without AVX-512.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgelite.config import RuntimeConfig
from edgelite.engine.onnxgraph import (
    FLOAT,
    GRAPH_INIT,
    GRAPH_INPUT,
    GRAPH_NAME,
    GRAPH_NODE,
    GRAPH_OUTPUT,
    INT64,
    MODEL_GRAPH,
    MODEL_IR_VERSION,
    NODE_INPUT,
    NODE_OP,
    NODE_OUTPUT,
    UINT8,
    Field,
    encode,
    hidden_input,
    make_node,
    make_tensor,
    make_value_info,
    node_attrs,
    with_opset,
)
from edgelite.engine.passes.base import Pass, apply, each_replaced
from edgelite.engine.session import options

log = logging.getLogger(__name__)

PREFIX = "edgelite_onerow"  # names of what the rewrite adds
PROBE_K, PROBE_N, PROBE_ROWS = 512, 128, 4  # the probe's product: K x N, this many rows tried
Kind = tuple[int, int, int]  # a MatMulNBits' bits, block size, accuracy level
# the accuracy levels padded: 4 (int8 compute, the fast exports'), where two rows cost 1.2x
# one (576 x 1536, 1 thread, AVX2). At level 0 (float compute, exact exports) they cost 1.9x:
# exact mode's products are left as they are (about 1e-5 relative between the two)
PADDED_LEVELS = (4,)


_varies: dict[Kind, bool] = {}  # (asked once a process)


def varies(kind: Kind, cfg: RuntimeConfig) -> bool:
    """Whether this onnxruntime, on this CPU, computes a row of a MatMulNBits of `kind` alone
    otherwise than in a step of two (bit for bit, on PROBE_ROWS random rows); `cfg`: the
    sessions' options (the process's thread pool)."""
    if kind not in _varies:
        _varies[kind] = _probe(kind, cfg)
    return _varies[kind]


def _probe(kind: Kind, cfg: RuntimeConfig) -> bool:
    session = ort.InferenceSession(product_model(kind, PROBE_K, PROBE_N), options(cfg, Path(".")),
                                   providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((PROBE_ROWS, PROBE_K)).astype(np.float32)
    for row in x:
        alone = session.run(None, {"hidden": row[None, None]})[0][0, 0]
        paired = session.run(None, {"hidden": np.stack([row, row])[None]})[0][0, 0]
        if not np.array_equal(alone, paired):
            log.info("this CPU's MatMulNBits (bits %d, block %d, accuracy level %d) computes a row "
                     "alone otherwise than with others: one-row steps run it on two rows", *kind)
            return True
    return False


def product_model(kind: Kind, k: int, n: int) -> bytes:
    """A model of one MatMulNBits of `kind` with random codes and scales: hidden (1, m, k) ->
    out (1, m, n). (Protobuf by hand: phones have no `onnx` package.)"""
    bits, block, level = kind
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, (n, k // block, block * bits // 8), dtype=np.uint8)
    scales = (rng.random((n, k // block), dtype=np.float32) * 0.02).astype(np.float32)
    node = make_node("MatMulNBits", ["hidden", "codes", "scales"], ["out"], "product", "com.microsoft",
                     K=k, N=n, bits=bits, block_size=block, accuracy_level=level)
    weights = [make_tensor("codes", UINT8, codes.ravel().tolist(), list(codes.shape)),
               make_tensor("scales", FLOAT, scales.ravel().tolist(), list(scales.shape))]
    graph = encode([(GRAPH_NODE, 2, node), (GRAPH_NAME, 2, b"product"),
                    *((GRAPH_INIT, 2, w) for w in weights),
                    (GRAPH_INPUT, 2, make_value_info("hidden", FLOAT, [1, "m", k])),
                    (GRAPH_OUTPUT, 2, make_value_info("out", FLOAT, [1, "m", n]))])
    model = encode([(MODEL_IR_VERSION, 0, 8), (MODEL_GRAPH, 2, graph)])
    return with_opset(with_opset(model, "", 17), "com.microsoft", 1)


def pad_products_pass(cfg: RuntimeConfig) -> Pass:
    """The pass that gives each MatMulNBits that `varies` on this machine two rows in a
    one-row step (see the module's text)."""
    return Pass("products-padded", lambda graph: _pad_graph(graph, cfg),
                "cannot make the products row-invariant")


def pad_products(model: bytes, cfg: RuntimeConfig) -> bytes:
    """The model with `pad_products_pass` run over it (unchanged where no product varies)."""
    return apply(model, [pad_products_pass(cfg)])


def _pad_graph(graph: bytes, cfg: RuntimeConfig) -> bytes:
    def pad(i: int, inputs: list[str], outputs: list[str], rest: list[Field]) -> list[Field] | None:
        attrs = node_attrs(rest)
        kind = (int(attrs.get("bits", 4)), int(attrs.get("block_size", 0)),
                int(attrs.get("accuracy_level", 0)))
        if kind[2] not in PADDED_LEVELS or not varies(kind, cfg):
            return None
        return padded_node(PREFIX, f"{PREFIX}/{i}", "MatMulNBits", inputs, outputs, rest, (0,), -2,
                           f"{PREFIX}/minus2_1d")

    items, count = each_replaced(graph, "MatMulNBits", pad)
    if not count:
        return graph
    hidden = hidden_input(graph, "hidden")  # (batch, rows, width): a range's or the head's
    if not hidden:
        raise ValueError("the graph has no hidden input to count a step's rows by")
    return encode([*row_indices(PREFIX, hidden), *items, *((GRAPH_INIT, 2, c) for c in _constants())])


def padded_node(prefix: str, tag: str, op: str, inputs: list[str], outputs: list[str], rest: list[Field],
                rows_at: tuple[int, ...], axis: int, axis_1d: str) -> list[Field]:
    """A node of type `op` whose inputs at `rows_at` are gathered by the shared indices
    (`prefix`/rows, on `axis`) and whose first output keeps the step's m rows (a Slice on that
    axis, `axis_1d` the constant naming it); its other outputs as they are. (engine/passes/invariant.py
    pads its attention so.)"""
    items: list[Field] = []
    new = list(inputs)
    for i in rows_at:
        if inputs[i]:  # (an empty input: an optional one not given)
            new[i] = f"{tag}/padded_{i}"
            items.append((GRAPH_NODE, 2, make_node("Gather", [inputs[i], f"{prefix}/rows"], [new[i]], new[i],
                                                   axis=axis)))
    wide = f"{tag}/output_padded"
    items.append((GRAPH_NODE, 2, encode([*((NODE_INPUT, 2, x.encode()) for x in new),
                                         (NODE_OUTPUT, 2, wide.encode()),
                                         *((NODE_OUTPUT, 2, x.encode()) for x in outputs[1:]),
                                         (NODE_OP, 2, op.encode()), *rest])))
    items.append((GRAPH_NODE, 2, make_node("Slice", [wide, f"{prefix}/zero_1d", f"{prefix}/m_1d", axis_1d],
                                           [outputs[0]], f"{tag}/drop_pad")))
    return items


def row_indices(prefix: str, hidden: str) -> list[Field]:
    """The nodes a graph padded so shares, named under `prefix`: m, the step's rows (the hidden
    input's second dimension); pad, 1 when m is 1, else 0; rows, the indices [0, ..., m - 1],
    or [0, 0] when m is 1; m_1d, m as a 1-d tensor (a slice's end); and the constants they
    use (zero, one, zero_1d). engine/passes/invariant.py's padded attention shares them too."""
    p = prefix
    spec = [("Gather", ["shape", "one"], "m", {"axis": 0}),
            ("Equal", ["m", "one"], "single", {}), ("Cast", ["single"], "pad", {"to": INT64}),
            ("Add", ["m", "pad"], "n", {}), ("Range", ["zero", "n", "one"], "range", {}),
            ("Sub", ["m", "one"], "last", {}), ("Min", ["range", "last"], "rows", {}),
            ("Unsqueeze", ["m", "zero_1d"], "m_1d", {})]
    out = [(GRAPH_NODE, 2, make_node("Shape", [hidden], [f"{p}/shape"], f"{p}/shape"))]
    out += [(GRAPH_NODE, 2, make_node(op, [f"{p}/{x}" for x in ins], [f"{p}/{o}"], f"{p}/{o}", **attrs))
            for op, ins, o, attrs in spec]
    constants = [make_tensor(f"{p}/zero", INT64, [0], []), make_tensor(f"{p}/one", INT64, [1], []),
                 make_tensor(f"{p}/zero_1d", INT64, [0], [1])]
    return out + [(GRAPH_INIT, 2, c) for c in constants]


def _constants() -> list[bytes]:
    return [make_tensor(f"{PREFIX}/minus2_1d", INT64, [-2], [1])]
