"""Folding a graph's constant part as it loads (engine/fold.py): the same outputs as
onnxruntime's own folding, the folded tensors' pages out of the resident set once the session
is made, and a clear error for a data file that is too short."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from edgelite import manifest as mf
from edgelite.config import RuntimeConfig
from edgelite.engine import session as sess
from edgelite.engine.layers import LayerRange, export_files
from edgelite.engine.runtime import Embedding, Head
from edgelite.errors import ModelFileError

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def q6k(ggufs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Q4_K + Q6_K model, fast mode: K-quant scales as float16 x int8, Q6_K's 6-bit
    codes in 8-bit storage written at 6 bits: the graphs widen both as they load."""
    from edgelite_export import build

    out = tmp_path_factory.mktemp("fold") / "q6k"
    return build.run(str(ggufs["Q4_K+Q6_K"]), out, build.Options(steps=4)).out


def _resident_kib(address: int) -> int:
    """Rss of the mapping of this process that holds `address`."""
    rss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("Rss:"):
            rss += int(line.split()[1])
    return rss


def _outputs(model: Path, fold: bool) -> list[np.ndarray]:
    m = mf.load(model)
    cfg = RuntimeConfig(threads=1, fold_at_load=fold)
    files = export_files(m)
    lr = LayerRange(m, 0, m.num_layers - 1, cfg, files)
    slot = lr.pool.acquire()
    ids = np.array([[1, 7, 3, 12, 5]])
    x = Embedding(m, cfg, files).run(ids)
    y = np.array(lr.run(slot, x))
    y1 = np.array(lr.run(slot, x[:, -1:]))
    return [x, y, y1, Head(m, cfg, files).run(y1)]


def test_folding_at_load_matches_onnxruntime_and_gives_its_pages_back(q6k: Path) -> None:
    ours, theirs = _outputs(q6k, True), _outputs(q6k, False)
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
    m = mf.load(q6k)
    graph = (q6k / m.layers[0].file).read_bytes()
    folded = sess.fold.fold(graph, q6k)
    assert folded.names and b"BitShift" in graph and b"BitShift" not in folded.model
    assert b"Cast" in graph and len(folded.model) < len(graph)
    session = sess.open_model(graph, q6k, RuntimeConfig(threads=1), "layer 0")
    held = sess._folded[session]
    assert held.mapping is not None
    address = np.frombuffer(held.mapping, np.uint8).ctypes.data
    # onnxruntime has packed the folded tensors: none of their pages is resident any more
    assert _resident_kib(address) == 0


def test_a_short_data_file_is_one_line_naming_it(q6k: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(q6k, bad)
    data = bad / mf.load(bad).layers[0].data[0].file
    data.write_bytes(data.read_bytes()[:100])
    graph = (bad / mf.load(bad).layers[0].file).read_bytes()
    with pytest.raises(ModelFileError) as err:  # (past the manifest's size check: the loader's own)
        sess.open_model(graph, bad, RuntimeConfig(threads=1), "layer 0")
    text = str(err.value)
    assert "\n" not in text and text.startswith("layer 0: ") and data.name in text and "shorter" in text
