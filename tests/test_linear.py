"""edgelite's MatMul4, MatMul4K, MatMul6 and MatMul8 and engine/passes/linear.py's rewrite of a
fast export's 4-bit, Q4_K, Q6_K and 8-bit MatMulNBits products (issue 35)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edgelite import manifest as mf
from edgelite.config import RuntimeConfig
from edgelite.engine import kernels, onnxgraph
from edgelite.engine.kernels import twins
from edgelite.engine.kernels.models import matmul_model
from edgelite.engine.layers import LayerRange, export_files
from edgelite.engine.passes import linear
from edgelite.engine.runtime import LocalChain
from edgelite.engine.session import options
from edgelite.reply.tokenizer import Tokenizer

pytestmark = pytest.mark.engine


def _library(*ops: str) -> Path:
    """The kernel library, where its `ops` have their vector path (MatMul4 and MatMul8: AVX2 or
    AVX-512 VNNI; MatMul4K and MatMul6: AVX-512 VNNI and VBMI); else the test is skipped."""
    library = kernels.library(RuntimeConfig(threads=1))
    assert library is not None, "the kernel library could not be built here"
    missing = set(ops) - kernels.matmul_kinds(library)
    if missing:
        pytest.skip(f"this CPU has no vector path for {', '.join(sorted(missing))}: not used here")
    return library


def _weights(op: str, k: int, n: int, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], tuple]:
    """Random weights: the operator's inputs, and the numpy twin's arguments."""
    if op == "MatMul4":
        codes = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
        scales = rng.uniform(-0.1, 0.1, (n, k // 32)).astype(np.float32)
        return dict(zip(("codes", "scales"), twins.interleaved(codes, scales), strict=True)), (codes, scales)
    if op == "MatMul8":
        codes = rng.integers(0, 256, (n, k // 32, 32), dtype=np.uint8)
        scales = rng.uniform(-0.1, 0.1, (n, k // 32)).astype(np.float32)
        return (dict(zip(("codes", "scales"), twins.interleaved8(codes, scales), strict=True)),
                (codes, scales, twins.ZERO8))
    if op == "MatMul4K":
        codes = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
        sc, mins = (rng.integers(0, 64, (n, k // 32), dtype=np.uint8) for _ in range(2))
        d, e = (rng.uniform(-0.01, 0.01, (n, k // 256)).astype(np.float16) for _ in range(2))
        args = (codes, sc, mins, d, e)
        return dict(zip(("codes", "mult", "base"), twins.interleaved4k(*args), strict=True)), args
    codes = rng.integers(0, 64, (n, k), dtype=np.uint8)
    mult = rng.integers(-128, 128, (n, k // 16), dtype=np.int8)
    base = rng.uniform(-0.01, 0.01, (n, k // 256)).astype(np.float32)
    return (dict(zip(("codes", "mult", "base"), twins.interleaved6(codes, mult, base), strict=True)),
            (codes, mult, base, twins.ZERO6))


def _twin(op: str, a: np.ndarray, args: tuple) -> np.ndarray:
    twin = {"MatMul4": twins.matmul4, "MatMul4K": twins.matmul4k, "MatMul6": twins.matmul6,
            "MatMul8": twins.matmul8}[op]
    return twin(a, *args)


def _run(library: Path, op: str, k: int, n: int, a: np.ndarray, weights: dict[str, np.ndarray],
         threads: int = 1) -> np.ndarray:
    opts = options(RuntimeConfig(threads=threads), Path("."))
    opts.register_custom_ops_library(str(library))
    model = matmul_model(op, k, n, threads)
    run = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"]).run
    return run(None, {"a": a, **weights})[0]


@pytest.mark.parametrize("op, shapes", [("MatMul4", ((96, 12), (576, 512))),
                                       ("MatMul4K", ((256, 12), (768, 512))),
                                       ("MatMul6", ((256, 12), (512, 512))),
                                       ("MatMul8", ((64, 12), (576, 512)))])
def test_the_product_is_numpys_and_each_row_the_same_in_any_chunking(op: str, shapes: tuple) -> None:
    """Against the numpy twin (MatMul4: blocks padded to 4 and not); each row the same bits
    alone, in tiles of 2, 3 and 4 rows, and split over two threads; codes at the zero point
    give zeros (up to the roundings of each lane's part of a block's zero sum; MatMul4K: with
    no minima)."""
    library = _library(op)
    rng = np.random.default_rng(3)
    for k, n in shapes:
        a = rng.standard_normal((9, k)).astype(np.float32)
        weights, args = _weights(op, k, n, rng)
        whole = _run(library, op, k, n, a, weights)
        want = _twin(op, a, args)
        assert np.allclose(whole, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        for cut in (1, 2, 3, 5):
            rows = np.concatenate([_run(library, op, k, n, a[s:s + cut], weights) for s in range(0, 9, cut)])
            assert np.array_equal(rows, whole), cut
        assert np.array_equal(_run(library, op, k, n, a, weights, threads=2), whole)
    weights, _ = _weights(op, 256, 4, rng)
    if op == "MatMul4":
        weights["codes"] = np.full_like(weights["codes"], 0x88)
    elif op == "MatMul8":
        weights, _ = _weights(op, 256, 4, rng)
        weights["codes"] = np.full_like(weights["codes"], twins.ZERO8)
    elif op == "MatMul4K":  # (with no minima: what is left is the block sums by 8 d sc)
        _, (_, sc, mins, d, e) = _weights(op, 256, 4, rng)
        args = (np.full((4, 8, 16), 0x88, np.uint8), sc, mins, d, np.zeros_like(e))
        weights = dict(zip(("codes", "mult", "base"), twins.interleaved4k(*args), strict=True))
        a = rng.standard_normal((2, 256)).astype(np.float32)
        got, want = _run(library, op, 256, 4, a, weights), twins.matmul4k(a, *args)
        assert np.abs(got - want).max() < 1e-6 * np.abs(want).max()
        return
    else:
        weights["codes"] = twins.interleaved6(np.full((4, 256), twins.ZERO6, np.uint8),
                                               np.ones((4, 16), np.int8), np.ones((4, 1), np.float32))[0]
    a = rng.standard_normal((2, 256)).astype(np.float32)
    scale = float(np.abs(weights.get("scales", 1.0)).max())  # (MatMul6: base and multiples of 1)
    assert np.abs(_run(library, op, 256, 4, a, weights)).max() < 1e-6 * np.abs(a).sum() * scale * 64


def _log_probs(model: Path, ids: np.ndarray, on: bool) -> np.ndarray:
    chain = LocalChain(mf.load(model), RuntimeConfig(threads=1, matmul_kernel=on))
    x = chain.logits_all("t", ids).astype(np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_a_k_quant_export_runs_its_q4_k_and_q6_k_products_in_matmul4k_and_matmul6(
        ggufs: dict[str, Path], tmp_path: Path) -> None:
    """A tiny Q4_K + Q6_K GGUF exported fast: its layers' and head's products all become
    MatMul4K (no minima product left, nor the block sums it read) and MatMul6, and the log
    probabilities are MatMulNBits' within the noise of int8 activations (a wrong layout of the
    weights is off by it all; a float rounding that differs by one in the last place may flip
    one activation code a layer later: one position off by ~0.1, measured)."""
    from edgelite_export import build

    _library("MatMul4K", "MatMul6")
    out = build.run(str(ggufs["Q4_K+Q6_K"]), tmp_path / "fast", build.Options(steps=4)).out
    m = mf.load(out)
    files = export_files(m, verify=False)
    ops = [op for e in (*m.layers, m.head) for op in _ops(linear.products(files.graph(e), e.products or ()))]
    assert "MatMul4K" in ops and "MatMul6" in ops and "MatMulNBits" not in ops, ops
    assert "MatMul4" not in ops and "MatMul" not in ops and "ReduceSum" not in ops, ops
    ids = np.array([[5, 17, 42, 8, 99, 3, 61, 7, 23, 11, 2, 90]])
    off, on = _log_probs(out, ids, False), _log_probs(out, ids, True)
    per_position = np.abs(off - on).reshape(-1, off.shape[-1]).max(-1)
    assert np.median(per_position) < 0.01 and per_position.max() < 0.5, per_position
    assert (off.argmax(-1) == on.argmax(-1)).all()


def _ops(model: bytes) -> list[str]:
    graph = next(v for n, _, v in onnxgraph.fields(model) if n == onnxgraph.MODEL_GRAPH)
    return [onnxgraph.node_parts(v)[0] for n, _, v in onnxgraph.fields(graph)  # type: ignore[arg-type]
            if n == onnxgraph.GRAPH_NODE]


def test_a_fast_export_runs_its_4_bit_products_in_matmul4_and_its_head_in_matmul8(smollm2_int4: Path) -> None:
    """SmolLM2's int4 fast export: every 4-bit product of a range becomes MatMul4 and the head's
    8-bit one MatMul8, and the chain's log probabilities over a text are those of MatMulNBits
    within the noise of int8 activations (a wrong layout of the weights is off by it all)."""
    _library("MatMul4", "MatMul8")
    m = mf.load(smollm2_int4)
    cfg = RuntimeConfig(threads=1)
    files = export_files(m, verify=False)
    two = m.layers[:2]
    joined = onnxgraph.join([files.graph(e) for e in two], files.locate, "two", [e.file for e in two])
    before, after = _ops(joined), _ops(linear.products(joined, linear.listed(two, m.name)))
    assert before.count("MatMulNBits") == 8 and after.count("MatMul4") == 8 and "MatMulNBits" not in after
    head = _ops(linear.products(files.graph(m.head), m.head.products or ()))
    assert head.count("MatMul8") == 1 and "MatMulNBits" not in head
    assert LayerRange(m, 0, 1, cfg, files).matmul is not None
    assert LayerRange(m, 0, 1, RuntimeConfig(threads=1, matmul_kernel=False), files).matmul is None
    ids = np.array([Tokenizer(m).encode("The river runs to the sea, and the sea is never full; to the place "
                                        "where the rivers come from, there they return again. " * 3)])
    out = {on: _log_probs(smollm2_int4, ids, on) for on in (False, True)}
    kl = float((np.exp(out[False]) * (out[False] - out[True])).sum(-1).mean())
    assert kl < 1e-2 and (out[False].argmax(-1) == out[True].argmax(-1)).mean() >= 0.9


def test_an_export_that_lists_no_products_keeps_them_until_upgraded(
        smollm2_int4: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The rewrite takes only the products the manifest lists (their kinds come from the
    exporter, exporter/products.py). An export made before they were listed runs every product
    as MatMulNBits and says so once; `edgelite-export upgrade DIR` lists them again (the same
    table the export wrote), and its files are unchanged."""
    import json
    import logging

    from edgelite_export.cli import main as export_main

    _library("MatMul4", "MatMul8")
    m = mf.load(smollm2_int4)
    assert all(e.products for e in (*m.layers, m.head)), "a fresh export lists its products"
    assert {p.kind for e in m.layers for p in e.products or ()} == {"q4"}
    assert [p.kind for p in m.head.products or ()] == ["q8"]
    old = tmp_path / "old"
    old.mkdir()
    for f in smollm2_int4.iterdir():
        if f.name != mf.MANIFEST_NAME:
            (old / f.name).symlink_to(f)
    data = json.loads((smollm2_int4 / mf.MANIFEST_NAME).read_text())
    for e in (data["embed"], data["head"], *data["layers"]):
        del e["products"]
    (old / mf.MANIFEST_NAME).write_text(json.dumps(data))
    stale = mf.load(old)
    files = export_files(stale, verify=False)
    with caplog.at_level(logging.WARNING, "edgelite.engine.passes.linear"):
        listed = linear.listed(stale.layers[:2], stale.name)
        linear.listed(stale.layers[2:4], stale.name)  # (said once)
    assert listed == [] and len([r for r in caplog.records if "upgrade" in r.getMessage()]) == 1
    assert "MatMul4" not in _ops(linear.products(files.graph(stale.layers[0]), listed))
    assert export_main(["upgrade", str(old)]) == 0
    fresh = mf.load(old)
    assert [e.products for e in fresh.layers] == [e.products for e in m.layers]
    assert fresh.head.products == m.head.products and fresh.fingerprint == m.fingerprint
    ops = _ops(linear.products(files.graph(fresh.layers[0]), linear.listed(fresh.layers[:1], fresh.name)))
    assert ops.count("MatMul4") == 4 and "MatMulNBits" not in ops


def test_a_manifests_product_table_is_checked_when_read(smollm2_int4: Path) -> None:
    """A product of an unknown kind, or without the parts its kind needs, is a one-line
    ManifestError naming it (a node never guesses)."""
    import json

    data = json.loads((smollm2_int4 / mf.MANIFEST_NAME).read_text())
    bad = json.loads(json.dumps(data))
    bad["layers"][3]["products"][0]["kind"] = "q5"
    with pytest.raises(mf.ManifestError, match=r"layers\[3\]\.products\[0\]\.kind 'q5'"):
        mf.parse(bad, smollm2_int4)
    bad = json.loads(json.dumps(data))
    bad["layers"][0]["products"][0] = {"kind": "q4_k", "node": "x", "parts": {"output": "y"}}
    with pytest.raises(mf.ManifestError, match=r"parts of a q4_k product must name min_base"):
        mf.parse(bad, smollm2_int4)
