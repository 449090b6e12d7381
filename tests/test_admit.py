"""Graph admission (engine/passes/admit.py): a graph edgelite's exporter would not write is
refused as it loads, with one line naming the node and what is wrong, before onnxruntime or
any kernel sees it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
from onnx import helper

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


CASES: dict[str, tuple[Callable[[onnx.GraphProto], None], str]] = {
    "loop": (_loop, "node 'spin': operator Loop is not one the exporter writes"),
    "custom op": (lambda g: g.node.append(helper.make_node("Attend", ["x"], ["y"], name="mine",
                                                           domain="edgelite")), "operator edgelite:Attend"),
    "heads overflow": (lambda g: _attr(_node(g, "GroupQueryAttention"), "num_heads", 2**60 + 3),
                       f"num_heads is {2**60 + 3}"),
    "no kv heads": (lambda g: _attr(_node(g, "GroupQueryAttention"), "kv_num_heads", 0), "kv_num_heads is 0"),
    "huge N": (lambda g: _attr(_node(g, "MatMulNBits"), "N", 2**24), "N=16777216"),
    "N against its codes": (lambda g: _attr(_node(g, "MatMulNBits"), "N", 8), "needs codes of shape [8,"),
}


@pytest.fixture(scope="module")
def int4_model(ggufs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    from edgelite_export import build

    return build.run(str(ggufs["Q4_1"]), tmp_path_factory.mktemp("admit") / "m", build.Options(steps=4)).out


@pytest.mark.parametrize("case", CASES)
def test_a_graph_the_exporter_would_not_write_is_refused_naming_the_node(
        int4_model: Path, tmp_path: Path, case: str) -> None:
    change, says = CASES[case]
    model = Path(shutil.copytree(int4_model, tmp_path / "m"))
    path = model / "layer_000.onnx"
    proto = onnx.load(str(path), load_external_data=False)
    change(proto.graph)
    path.write_bytes(proto.SerializeToString())
    data = json.loads((model / mf.MANIFEST_NAME).read_text())  # (the manifest made to match: only
    data["layers"][0].update(sha256=mf.sha256_file(path), bytes=path.stat().st_size)  # the graph lies)
    entries = [data["embed"], *data["layers"], data["head"]]
    data["fingerprint"] = mf.fingerprint_of([x for e in entries
                                             for x in (e["sha256"], *(d["sha256"] for d in e["data"]))])
    (model / mf.MANIFEST_NAME).write_text(json.dumps(data))
    m = mf.load(model)
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
