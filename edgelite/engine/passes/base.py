"""What a graph pass is, and how the chosen ones run: each a named graph-to-graph function
(the GraphProto's bytes in, the new bytes out), all of them over one parse of the model
(`apply`); the loop most share (`each_replaced`: every node of one operator replaced, or kept)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from edgelite.engine.kernels.models import DOMAIN
from edgelite.engine.onnxgraph import Field, each_node, with_graph, with_opset
from edgelite.errors import ModelFileError

Graph = bytes  # a GraphProto's bytes
FAULTS = (ValueError, KeyError, UnicodeDecodeError, IndexError)  # what a graph a pass cannot read raises


@dataclass(frozen=True)
class Pass:
    """One pass: its name (a node's stats list the chosen ones), its function, what a graph it
    cannot rewrite is said to be (the one-line error's start), and whether what it adds is
    edgelite's own operators (the model then imports their domain)."""

    name: str
    run: Callable[[Graph], Graph]
    failure: str
    ours: bool = False


def apply(model: bytes, passes: Sequence[Pass]) -> bytes:
    """The model with `passes` run in order over its graph (parsed once)."""
    changed: list[Pass] = []

    def run_all(graph: Graph) -> Graph:
        for p in passes:
            try:
                out = p.run(graph)
            except FAULTS as exc:
                raise ModelFileError(f"{p.failure}: {exc}") from exc
            if out is not graph:
                changed.append(p)
            graph = out
        return graph

    out = with_graph(model, run_all) if passes else model
    if not changed:
        return model
    return with_opset(out, DOMAIN, 1) if any(p.ours for p in changed) else out


Replace = Callable[[int, list[str], list[str], list[Field]], list[Field] | None]


def each_replaced(graph: Graph, op: str, replace: Replace) -> tuple[list[Field], int]:
    """The graph's fields with each `op` node given to `replace` (the number it would be among
    those replaced, from 1; inputs, outputs, its other fields) -> the fields in its place, or
    None to keep it; and how many were replaced."""
    items: list[Field] = []
    count = 0
    for field, node in each_node(graph, op):
        new = replace(count + 1, *node) if node is not None else None
        if new is None:
            items.append(field)
        else:
            items += new
            count += 1
    return items, count
