"""Transcoding GGUF blocks into MatMulNBits form rounds nothing: every type, checked against the
`gguf` package's own dequantizer, and the packed forms against a plain unpacking."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from edgelite_export import blocks

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
N, K = 6, 512
# where each type keeps float16 scales in its block (byte offset), to keep random blocks finite
F16_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
          "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def _random_raw(kind: str, rng: np.random.Generator) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[T[kind]]
    raw = rng.integers(0, 256, (N, K // block, size), dtype=np.uint8)
    for off in F16_AT[kind]:
        scales = rng.uniform(-0.05, 0.05, (N, K // block)).astype(np.float16)
        raw[..., off:off + 2] = scales.view(np.uint8).reshape(N, K // block, 2)
    return raw.reshape(N, -1)


@pytest.mark.unit
@pytest.mark.parametrize("kind", sorted(blocks.TRANSCODERS))
def test_transcode_equals_gguf_dequantize(kind: str) -> None:
    raw = _random_raw(kind, np.random.default_rng(len(kind)))
    want = gguf.quants.dequantize(raw, T[kind]).reshape(N, K)
    got = blocks.TRANSCODERS[kind](raw, N, K)
    assert got.shape == (N, K) and int(got.q.max()) < 1 << got.bits
    assert np.abs(got.dequantize() - want).max() <= 1e-6 * np.abs(want).max()
    centred = got.centered()  # zero points mid-range, minima absorbing the rest: same values
    centre = 128 if got.bits == 8 else 1 << ((got.code_bits or got.bits) - 1)  # (8-bit storage:
    assert np.all(centred.zero == centre)  # narrower codes move to the default zero point)
    assert np.abs(centred.dequantize() - want).max() <= 1e-6 * np.abs(want).max()
    for compute in ("exact", "fast"):  # the products the graph runs sum to the same values
        parts = got.products(compute)
        assert all(p.bits in (2, 4, 8) and int(p.q.max()) < 1 << p.bits for p in parts)
        both = np.sum([p.dequantize() for p in parts], axis=0)
        assert np.abs(both - want).max() <= 1e-6 * np.abs(want).max(), compute
    for f in (got.scale_factored, got.minimum_factored):  # stored compactly, exactly
        if f is not None:
            assert f.base.dtype == np.float16 and f.mult.itemsize == 1
    if got.scale_factored is not None:
        assert np.array_equal(got.scale_factored.value(), got.scale)


@pytest.mark.unit
@pytest.mark.parametrize("quant, bits", [(blocks.quantize_int8, 8), (blocks.quantize_int4, 4)])
def test_quantizing_floats_and_packing(quant, bits: int) -> None:
    w = np.random.default_rng(0).standard_normal((N, K)).astype(np.float32)
    b = quant(w)
    err = np.abs(b.dequantize() - w).max()
    assert err <= (0.02 if bits == 8 else 0.25), err
    packed = b.packed()
    assert packed.shape == (N, K // 32, 32 * bits // 8)
    if bits == 4:  # low nibble first
        assert np.array_equal(packed[..., 0] & 15, b.q[:, 0::32]) and \
            np.array_equal(packed[..., 0] >> 4, b.q[:, 1::32])
        zp = b.zero_points()
        assert zp is not None and np.array_equal(zp[:, 0] & 15, b.zero[:, 0])
    else:
        assert b.zero_points() is None  # the default 128


@pytest.mark.unit
def test_rows_concat_and_reorder() -> None:
    raw = _random_raw("Q4_1", np.random.default_rng(3))
    b = blocks.from_q4_1(raw, N, K)
    both = blocks.concat_rows([b, b.rows(np.arange(N)[::-1])])
    assert both is not None and both.shape == (2 * N, K)
    assert np.array_equal(both.dequantize()[N:], b.dequantize()[::-1])
    assert blocks.concat_rows([b, blocks.from_q8_0(_random_raw("Q8_0", np.random.default_rng(4)),
                                                   N, K)]) is None


@pytest.mark.engine
def test_an_exact_head_and_the_embedding_share_one_tied_table(tmp_path) -> None:
    """In exact mode a tied 8-bit table (Q8_0) is written once, as its two 4-bit halves, and
    both graphs read it: embedding rows equal the table's values, the head's logits x W^T."""
    from edgelite_export import graph

    vocab, hidden = 96, 64
    rng = np.random.default_rng(3)
    table = blocks.quantize_int8(rng.standard_normal((vocab, hidden)).astype(np.float32))
    hi, lo = table.halves()
    assert np.array_equal(hi.dequantize() + lo.dequantize(), table.dequantize())
    arch = graph.Arch(hidden=hidden, heads=2, kv_heads=2, head_dim=32, intermediate=128,
                      vocab=vocab, eps=1e-5)
    data = graph.DataFile(tmp_path / "embed_head.data")
    graph.embed(arch, table, data, tmp_path / "embed.onnx", graph.halves_head(table, "exact"))
    graph.head(arch, np.ones(hidden, np.float32), table, "exact", data, tmp_path / "head.onnx")
    data.close()
    one_table = table.q.nbytes + table.scale.size * 2 + vocab * (hidden // 32 // 2)  # + lo's zero points
    assert data.path.stat().st_size <= one_table + 4096, (data.path.stat().st_size, one_table)
    w = table.dequantize()
    normed, logits = _embed_and_head(tmp_path, w, rng.standard_normal((1, 3, hidden)).astype(np.float32))
    assert np.abs(logits[0] - normed[0] @ w.T).max() <= 1e-4 * np.abs(logits).max()


def _embed_and_head(folder, w: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The embedding and head graphs in `folder`, loaded by the engine: the embedding's rows
    are the table's `w`; the head's (normed, logits) for hidden states `x`."""
    from edgelite.config import RuntimeConfig
    from edgelite.engine.session import open_model

    cfg = RuntimeConfig(threads=1)
    emb = open_model((folder / "embed.onnx").read_bytes(), folder, cfg, "embed")
    ids = np.array([[0, 5, 95, 17]])
    assert np.array_equal(emb.run(None, {"input_ids": ids})[0][0], w[ids[0]])
    head = open_model((folder / "head.onnx").read_bytes(), folder, cfg, "head")
    normed, logits = head.run(["normed", "logits"], {"hidden": x})
    return normed, logits


@pytest.mark.engine
def test_a_tied_table_of_narrow_codes_is_stored_once_at_its_own_width(tmp_path) -> None:
    """Fast mode, a tied table of 6-bit codes in 8-bit storage (Q6_K's): the embedding, the
    head's product and the head's exact rows read one 6-bit copy of the codes, and each gives
    the table's values (the exact rows decode the 6-bit stream themselves)."""
    from edgelite.engine.runtime import ExactRows
    from edgelite_export import graph

    vocab, hidden = 96, 64
    rng = np.random.default_rng(5)
    q = rng.integers(128 - 32, 128 + 32, (vocab, hidden)).astype(np.uint8)
    scale = rng.uniform(0.01, 0.02, (vocab, hidden // 16)).astype(np.float32)
    table = blocks.Blocks(q=q, scale=scale, zero=np.full(scale.shape, 128, np.uint8), minimum=None,
                          bits=8, block=16)
    arch = graph.Arch(hidden=hidden, heads=2, kv_heads=2, head_dim=32, intermediate=128,
                      vocab=vocab, eps=1e-5)
    data = graph.DataFile(tmp_path / "embed_head.data")
    graph.embed(arch, table, data, tmp_path / "embed.onnx")
    graph.head(arch, np.ones(hidden, np.float32), table, "fast", data, tmp_path / "head.onnx")
    spec = graph.exact_rows(table, data)
    data.close()
    assert spec is not None and spec["code_width"] == 6
    assert data.path.stat().st_size <= q.nbytes * 6 // 8 + scale.nbytes + 4096
    w = table.dequantize()
    normed, logits = _embed_and_head(tmp_path, w, rng.standard_normal((1, 1, hidden)).astype(np.float32))
    exact = normed[0, 0] @ w.T
    assert np.abs(logits[0, 0] - exact).max() <= 0.05 * np.abs(exact).max()  # (int8 activations)
    rescored = logits[0, 0].copy()
    ExactRows(spec, data.path, 8).rescore(normed[0, 0], rescored)
    top = np.argsort(logits[0, 0])[-8:]
    assert np.allclose(rescored[top], exact[top], rtol=1e-5, atol=1e-6)


@pytest.mark.engine
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_codes_narrower_than_their_storage_are_widened_exactly_when_loaded(bits: int,
                                                                           tmp_path) -> None:
    """Codes that span fewer values than the storage holds are written at their own width
    (graph.Linears.codes) and the graph gives the storage's bytes back exactly, for every
    narrower width and with an offset: folded by onnxruntime, and by the engine's own folding
    (engine/fold.py) as sessions load."""
    import onnxruntime as ort
    from onnx import TensorProto

    from edgelite.config import RuntimeConfig
    from edgelite.engine import fold
    from edgelite.engine.session import options
    from edgelite_export.blocks import Blocks
    from edgelite_export.graph import DataFile, Graph, Linears

    rng = np.random.default_rng(bits)
    for width in range(1, bits):
        low = int(rng.integers(0, (1 << bits) - (1 << width) + 1))
        q = (rng.integers(0, 1 << width, (24, 64)) + low).astype(np.uint8)
        b = Blocks(q=q, scale=np.ones((24, 2), np.float32), zero=np.zeros((24, 2), np.uint8),
                   minimum=None, bits=bits, block=32)
        folder = tmp_path / f"w{width}"
        folder.mkdir()
        data = DataFile(folder / "m.data")
        g = Graph("codes", data)
        out = Linears(g, "fast").codes(b, "codes")
        data.close()
        assert any(n.op_type == "BitShift" for n in g.nodes)  # (written narrower)
        # (counted as held once loaded: the storage's bytes, and a few small constants)
        assert 0 <= g.param_bytes - b.packed().nbytes < 256
        g.output(out, TensorProto.UINT8, list(b.packed().shape))
        g.save(folder / "m.onnx")
        plain = replace(RuntimeConfig(threads=1), fold_at_load=False)  # (onnxruntime folds)
        got = ort.InferenceSession(str(folder / "m.onnx"), options(plain, folder),
                                   providers=["CPUExecutionProvider"]).run(None, {})
        assert np.array_equal(got[0], b.packed()), (bits, width, low)
        folded = fold.fold((folder / "m.onnx").read_bytes(), folder)
        assert folded.names == [out] and b"BitShift" not in folded.model
        assert np.array_equal(folded.values[0].numpy(), b.packed()), (bits, width, low)
