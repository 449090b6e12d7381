"""Transcoding GGUF blocks into MatMulNBits form rounds nothing: every type, checked against the
`gguf` package's own dequantizer, and the packed forms against a plain unpacking."""

from __future__ import annotations

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


def test_rows_concat_and_reorder() -> None:
    raw = _random_raw("Q4_1", np.random.default_rng(3))
    b = blocks.from_q4_1(raw, N, K)
    both = blocks.concat_rows([b, b.rows(np.arange(N)[::-1])])
    assert both is not None and both.shape == (2 * N, K)
    assert np.array_equal(both.dequantize()[N:], b.dequantize()[::-1])
    assert blocks.concat_rows([b, blocks.from_q8_0(_random_raw("Q8_0", np.random.default_rng(4)),
                                                   N, K)]) is None


def test_an_exact_head_and_the_embedding_share_one_tied_table(tmp_path) -> None:
    """In exact mode a tied 8-bit table (Q8_0) is written once, as its two 4-bit halves, and
    both graphs read it: embedding rows equal the table's values, the head's logits x W^T."""
    from edgelite.config import RuntimeConfig
    from edgelite.engine.session import open_model
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
    cfg = RuntimeConfig(threads=1)
    emb = open_model((tmp_path / "embed.onnx").read_bytes(), tmp_path, cfg, "embed")
    ids = np.array([[0, 5, 95, 17]])
    assert np.array_equal(emb.run(None, {"input_ids": ids})[0][0], w[ids[0]])
    head = open_model((tmp_path / "head.onnx").read_bytes(), tmp_path, cfg, "head")
    x = rng.standard_normal((1, 3, hidden)).astype(np.float32)
    normed, logits = head.run(["normed", "logits"], {"hidden": x})
    assert np.abs(logits[0] - normed[0] @ w.T).max() <= 1e-4 * np.abs(logits).max()
