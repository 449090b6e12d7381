"""Graph admission (engine/passes/admit.py): a graph edgelite's exporter would not write is
refused as it loads, with one line naming the node and what is wrong, before onnxruntime or
any kernel sees it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from edgelite import manifest as mf
from edgelite.config import RuntimeConfig
from edgelite.engine.layers import LayerRange, export_files
from edgelite.errors import ModelFileError

pytestmark = pytest.mark.engine


def _attr(node: onnx.NodeProto, name: str, value: int) -> None:
    for a in node.attribute:
        if a.name == name:
            a.i = value
            return
    node.attribute.append(helper.make_attribute(name, value))


def _node(g: onnx.GraphProto, op: str) -> onnx.NodeProto:
    return next(n for n in g.node if n.op_type == op)


def _loop(g: onnx.GraphProto) -> None:
    body = helper.make_graph([], "body", [], [])
    g.node.append(helper.make_node("Loop", ["", ""], [], name="spin", body=body))


def _inline(g: onnx.GraphProto) -> None:
    g.initializer.append(numpy_helper.from_array(np.ones(1000, np.float32), "fat"))


def _constant_product(g: onnx.GraphProto) -> None:
    g.initializer.append(numpy_helper.from_array(np.ones((2, 2), np.float32), "small"))
    g.node.append(helper.make_node("MatMul", ["small", "small"], ["square"], name="folded by onnxruntime"))


def _cube(g: onnx.GraphProto) -> None:
    """A norm's weight (H values, external) broadcast to H x H and then H^3 values, read by a
    node that runs: fold.py would compute it at load."""
    w = next(t for t in g.initializer if len(t.dims) == 1 and t.data_location == onnx.TensorProto.EXTERNAL
             and t.data_type == onnx.TensorProto.FLOAT)
    h = w.dims[0]
    for name, shape in (("col", [h, 1]), ("row", [1, h]), ("tall", [h * h, 1])):
        g.initializer.append(numpy_helper.from_array(np.array(shape, np.int64), f"{name}_shape"))
    hidden = g.input[0].name
    g.node.extend([
        helper.make_node("Reshape", [w.name, "col_shape"], ["col"], name="col"),
        helper.make_node("Reshape", [w.name, "row_shape"], ["row"], name="row"),
        helper.make_node("Add", ["col", "row"], ["square"], name="square"),
        helper.make_node("Reshape", ["square", "tall_shape"], ["tall"], name="tall"),
        helper.make_node("Add", ["tall", "row"], ["cube"], name="cube"),
        helper.make_node("Mul", ["cube", hidden], ["junk"], name="junk"),
    ])
    g.output.append(helper.make_tensor_value_info("junk", onnx.TensorProto.FLOAT, None))


CASES: dict[str, tuple[Callable[[onnx.GraphProto], None], str]] = {
    "loop": (_loop, "node 'spin': operator Loop is not one the exporter writes"),
    "custom op": (lambda g: g.node.append(helper.make_node("Attend", ["x"], ["y"], name="mine",
                                                           domain="edgelite")), "operator edgelite:Attend"),
    "heads overflow": (lambda g: _attr(_node(g, "GroupQueryAttention"), "num_heads", 2**60 + 3),
                       f"num_heads is {2**60 + 3}"),
    "no kv heads": (lambda g: _attr(_node(g, "GroupQueryAttention"), "kv_num_heads", 0), "kv_num_heads is 0"),
    "huge N": (lambda g: _attr(_node(g, "MatMulNBits"), "N", 2**24), "N=16777216"),
    "N against its codes": (lambda g: _attr(_node(g, "MatMulNBits"), "N", 8), "needs codes of shape [8,"),
    "weights in the graph": (_inline, "initializer 'fat' of dims [1000] is held in the graph"),
    "a product of constants": (_constant_product, "node 'folded by onnxruntime': MatMul is computed from "
                                                  "constants alone"),
}


def _changed(int4_model: Path, tmp_path: Path, change: Callable[[onnx.GraphProto], None]) -> mf.Manifest:
    """The model with layer 0's graph changed, its manifest made to match (only the graph lies)."""
    model = Path(shutil.copytree(int4_model, tmp_path / "m"))
    path = model / "layer_000.onnx"
    proto = onnx.load(str(path), load_external_data=False)
    change(proto.graph)
    path.write_bytes(proto.SerializeToString())
    data = json.loads((model / mf.MANIFEST_NAME).read_text())
    data["layers"][0].update(sha256=mf.sha256_file(path), bytes=path.stat().st_size)
    entries = [data["embed"], *data["layers"], data["head"]]
    data["fingerprint"] = mf.fingerprint_of([x for e in entries
                                             for x in (e["sha256"], *(d["sha256"] for d in e["data"]))])
    (model / mf.MANIFEST_NAME).write_text(json.dumps(data))
    return mf.load(model)


@pytest.mark.parametrize("case", CASES)
def test_a_graph_the_exporter_would_not_write_is_refused_naming_the_node(
        int4_model: Path, tmp_path: Path, case: str) -> None:
    change, says = CASES[case]
    m = _changed(int4_model, tmp_path, change)
    with pytest.raises(ModelFileError) as caught:
        LayerRange(m, 0, 0, RuntimeConfig(threads=1), export_files(m)).close()
    text = str(caught.value)
    assert text.startswith("the graph is not one edgelite's exporter writes: ") and says in text, text
    assert "\n" not in text


def test_the_exports_own_graphs_are_admitted(int4_model: Path) -> None:
    m = mf.load(int4_model)
    layers = LayerRange(m, 0, m.num_layers - 1, RuntimeConfig(threads=1), export_files(m))
    assert layers.passes[0] == "admit"
    layers.close()


def test_a_constant_that_would_grow_past_its_weights_is_refused_before_it_is_computed(
        int4_model: Path, tmp_path: Path) -> None:
    m = _changed(int4_model, tmp_path, _cube)
    with pytest.raises(ModelFileError, match=r"folding cube: cube would take \d+ bytes, over \d+ \(16x the "):
        LayerRange(m, 0, 0, RuntimeConfig(threads=1), export_files(m)).close()
