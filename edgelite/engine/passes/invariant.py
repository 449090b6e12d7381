"""Attention whose every row is the same however many rows run together.

onnxruntime's GroupQueryAttention computes a step of one new position (a decode token) with
other kernels than a step of several (a prompt chunk: matrix products instead of vector ones),
so the same position comes out a little different (7e-7 measured) when decoded than when it
was part of a chunk. Under int8 activations (fast mode) such a difference flips roundings and
grows: the reply then depends on how the prompt was chunked, on the split, and on whether its
KV came from the KV store. With two or more rows the results are the same row by row,
whatever their number, their chunk's boundaries or what came before (measured bit for bit;
the other ops of a fast layer, MatMulNBits at accuracy level 4, MatMul and the norms, are
the same for any number of rows already).

`pad_attention` rewrites a joined range so that a one-row step's attention runs on two rows,
the row and a copy of it, and drops the copy from its output; steps of several rows run as
they are. The shape arithmetic is in the graph (the step's rows from the hidden input's
shape, `pad` 1 for one row, else 0), so one session serves both. The copy's keys and values
are written one position past the step's (a KV slot holds one position more; the next step
overwrites them). The price is a one-row step through the several-row kernels: little at
short contexts, more at long ones (they pack K and V: bench_invariant.py). onnxruntime
refuses several rows per session in a batch of sessions, so a range rewritten so runs decode
steps one session at a time.
"""

from __future__ import annotations

from edgelite.engine.onnxgraph import (
    GRAPH_INIT,
    GRAPH_NODE,
    INT32,
    INT64,
    Field,
    encode,
    hidden_input,
    make_node,
    make_tensor,
)
from edgelite.engine.passes import onerow
from edgelite.engine.passes.base import Pass, apply, each_replaced

PREFIX = "edgelite_invariant"  # names of what the rewrite adds


def pad_attention_pass() -> Pass:
    """The pass that gives each GroupQueryAttention two rows for a one-row step (see the
    module's text)."""
    return Pass("attend-padded", _pad_graph, "cannot make the range's attention row-invariant")


def pad_attention(model: bytes) -> bytes:
    """The model with `pad_attention_pass` run over it."""
    return apply(model, [pad_attention_pass()])


def _pad_graph(graph: bytes) -> bytes:
    lengths: list[str] = []  # seqlens and total: the range's own inputs, shared by its layers

    def pad(i: int, inputs: list[str], outputs: list[str], rest: list[Field]) -> list[Field]:
        new_inputs = list(inputs)
        lengths[:] = inputs[5:7]
        new_inputs[5:7] = (f"{PREFIX}/{x}" for x in lengths)
        # query, key, value gathered (key and value are empty when packed)
        return onerow.padded_node(PREFIX, f"{PREFIX}/{i}", "GroupQueryAttention", new_inputs, outputs,
                                  rest, (0, 1, 2), 1, f"{PREFIX}/one_1d")

    items, count = each_replaced(graph, "GroupQueryAttention", pad)
    if not count:
        return graph
    hidden = hidden_input(graph)
    if not hidden:
        raise ValueError("the range has no hidden_* input")
    return encode([*_shared(hidden, *lengths), *items, *((GRAPH_INIT, 2, c) for c in _constants())])


def _shared(hidden: str, seqlens: str, total: str) -> list[Field]:
    """The nodes every attention of the range shares: the step's rows and their indices
    (onerow.row_indices: m, pad, rows, m_1d); seqlens and total plus pad."""
    p = PREFIX
    out = onerow.row_indices(p, hidden)
    out.append((GRAPH_NODE, 2, make_node("Cast", [f"{p}/pad"], [f"{p}/pad32"], f"{p}/pad32", to=INT32)))
    for name in (seqlens, total):
        out.append((GRAPH_NODE, 2, make_node("Add", [name, f"{p}/pad32"], [f"{p}/{name}"], f"{p}/{name}")))
    return out


def _constants() -> list[bytes]:
    return [make_tensor(f"{PREFIX}/one_1d", INT64, [1], [1])]
