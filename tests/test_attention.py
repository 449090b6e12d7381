"""engine/passes/attention.py: GroupQueryAttention rewritten in plain operators over the valid KV, or
into edgelite's own operator (engine/kernels), gives onnxruntime's own results (float32 KV),
the same bit for bit however a sequence's steps are cut (float32 and float16 KV), for grouped,
one-per-head and windowed attention, packed or not. engine/kernels/build.py builds, checks
and rebuilds its library, and says in one line why there is none."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edgelite.config import RuntimeConfig
from edgelite.engine import kernels
from edgelite.engine.kernels import build
from edgelite.engine.passes.attention import plain_attention
from edgelite.engine.session import options
from edgelite.errors import ModelFileError

pytestmark = pytest.mark.engine

D, CAP, ROT = 16, 320, 16


def _model(heads: int, kv: int, window: int, packed: bool, d: int = D) -> bytes:
    f32 = TensorProto.FLOAT
    width = (heads + 2 * kv) * d if packed else heads * d
    inputs = [helper.make_tensor_value_info("hidden_0", f32, [1, "n", width])]
    if not packed:
        inputs += [helper.make_tensor_value_info(x, f32, [1, "n", kv * d]) for x in ("k", "v")]
    kv_shape = [1, kv, CAP, d]
    inputs += [helper.make_tensor_value_info("past_key_0", f32, kv_shape),
               helper.make_tensor_value_info("past_value_0", f32, kv_shape),
               helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
               helper.make_tensor_value_info("total_seq", TensorProto.INT32, []),
               helper.make_tensor_value_info("cos_cache", f32, [CAP, ROT // 2]),
               helper.make_tensor_value_info("sin_cache", f32, [CAP, ROT // 2])]
    extra = {"local_window_size": window} if window else {}
    node = helper.make_node(
        "GroupQueryAttention",
        ["hidden_0", "" if packed else "k", "" if packed else "v", "past_key_0", "past_value_0",
         "seqlens_k", "total_seq", "cos_cache", "sin_cache"],
        ["hidden_1", "present_key_0", "present_value_0"], domain="com.microsoft",
        num_heads=heads, kv_num_heads=kv, scale=0.3, do_rotary=1, rotary_interleaved=0, **extra)
    graph = helper.make_graph([node], "g", inputs, [
        helper.make_tensor_value_info("hidden_1", f32, [1, "n", heads * d]),
        helper.make_tensor_value_info("present_key_0", f32, kv_shape),
        helper.make_tensor_value_info("present_value_0", f32, kv_shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    return model.SerializeToString()


def _run(model: bytes, dtype: type, feeds: dict[str, np.ndarray], cuts: list[int],
         library: Path | None = None, d: int = D, threads: int = 1) -> np.ndarray:
    """The attention output of every position, run in steps of `cuts` positions, the KV bound
    in place as engine/layers.py binds it, on a pool of `threads` (the process's, if made)."""
    opts = options(RuntimeConfig(threads=1), Path("."))
    opts.intra_op_num_threads = threads
    if library is not None:
        opts.register_custom_ops_library(str(library))
    s = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    row = d + 2 * (dtype == np.int8)  # (an int8 row's step: two bytes)
    kv = [np.zeros((1, feeds["k"].shape[2] // d, CAP, row), dtype) for _ in range(2)]
    angles = np.outer(np.arange(CAP), 1.0 / 10000 ** (np.arange(0, ROT, 2) / ROT))
    tables = {"cos_cache": np.cos(angles).astype(np.float32), "sin_cache": np.sin(angles).astype(np.float32)}
    names = {i.name for i in s.get_inputs()}
    out, pos = [], 0
    for n in cuts:
        step = {"seqlens_k": np.array([pos + n - 1], np.int32), "total_seq": np.array(pos + n, np.int32),
                **tables}
        if "k" in names:
            step |= {x: feeds[x][:, pos:pos + n] for x in ("hidden_0", "k", "v")}
        else:
            step["hidden_0"] = np.concatenate([feeds[x][:, pos:pos + n] for x in ("hidden_0", "k", "v")], -1)
        io = s.io_binding()
        for name, arr in step.items():
            io.bind_cpu_input(name, np.ascontiguousarray(arr))
        io.bind_output("hidden_1")  # (the first output copy_outputs_to_cpu gives)
        for i, kind in enumerate(("key", "value")):
            io.bind_input(f"past_{kind}_0", "cpu", 0, dtype, list(kv[i].shape), kv[i].ctypes.data)
            io.bind_output(f"present_{kind}_0", "cpu", 0, dtype, list(kv[i].shape), kv[i].ctypes.data)
        s.run_with_iobinding(io)
        out.append(io.copy_outputs_to_cpu()[0])
        pos += n
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("use_kernel", [False, True], ids=["operators", "kernel"])
# (the kernel: head size 16 and a group of 9 take its general tile, 32 its grouped one)
@pytest.mark.parametrize("heads,kv,window,packed,d", [
    (4, 2, 0, True, 16), (6, 2, 0, False, 32), (4, 4, 0, True, 32), (4, 2, 5, False, 16),
    (4, 2, 40, False, 32), (3, 3, 4, True, 32), (9, 1, 3, True, 32)])
def test_plain_attention_equals_group_query_attention_and_ignores_how_steps_are_cut(
        heads: int, kv: int, window: int, packed: bool, d: int, use_kernel: bool) -> None:
    library = kernels.library(RuntimeConfig(threads=1)) if use_kernel else None
    assert library is not None or not use_kernel, "no attention kernel on a machine with a C compiler"
    rng = np.random.default_rng(heads * 10 + kv + window)
    n = 300 if window else 21  # (past 256: a windowed layer's keys then start further on)
    feeds = {"hidden_0": rng.standard_normal((1, n, heads * d)).astype(np.float32),
             "k": rng.standard_normal((1, n, kv * d)).astype(np.float32),
             "v": rng.standard_normal((1, n, kv * d)).astype(np.float32)}
    model = _model(heads, kv, window, packed, d)
    reference = _run(model, np.float32, feeds, [8, 8, n - 16], None, d)
    kinds = [(np.float32, "float32", 1e-5), (np.float16, "float16", 2e-2)]
    for dtype, name, tol in kinds + [(np.int8, "int8", 6e-2)] * use_kernel:
        plain = plain_attention(model, d, ROT, name, use_kernel, threads=2)  # (long chunks: 2 threads)
        whole = _run(plain, dtype, feeds, [16, n - 16], library, d)
        np.testing.assert_allclose(whole, reference, atol=tol, rtol=tol, err_msg=name)
        if use_kernel:  # the long chunk's tiles on onnxruntime's two threads: the same bits
            np.testing.assert_array_equal(_run(plain, dtype, feeds, [16, n - 16], library, d, 2), whole)
        for cuts in ([1] * n, [3, 1, 16, n - 20], [2, 7, n - 9]):
            got = _run(plain, dtype, feeds, cuts, library, d)
            np.testing.assert_array_equal(got, whole, err_msg=f"{name} {cuts}")


def test_a_graph_it_cannot_rewrite_gets_one_line() -> None:
    model = onnx.load_from_string(_model(4, 2, 0, True))
    model.graph.input.pop(0)  # no hidden_* input left to take the step's rows from
    with pytest.raises(ModelFileError, match="cannot rewrite the range's attention: the range has no hidden"):
        plain_attention(model.SerializeToString(), D, ROT)
    with pytest.raises(ModelFileError, match="KV dtype 'int4'"):
        plain_attention(_model(4, 2, 0, True), D, ROT, "int4")


def test_the_kernel_is_rebuilt_over_a_broken_library_and_missing_compilers_get_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    cfg = RuntimeConfig(threads=1)
    shared = kernels.library(cfg)  # (this session's build, under the same name: no second build)
    assert shared is not None, "no attention kernel on a machine with a C compiler"
    (tmp_path / "kernels").mkdir()
    for f in (shared, shared.with_name(shared.name + build.OK_SUFFIX)):
        shutil.copyfile(f, tmp_path / "kernels" / f.name)
    monkeypatch.setenv("EDGELITE_CACHE", str(tmp_path))
    found = build.build(cfg)  # a library already there, checked before, is taken as it is
    assert found == tmp_path / "kernels" / shared.name and build.checked(found, cfg) is None
    found.write_bytes(b"not a library")  # (a truncated copy, another machine's build)
    assert build.checked(found, cfg) is not None  # (its stamp no longer matches: checked again, fails)
    (tmp_path / "cc").write_text("#!/bin/sh\nexit 0\n")  # a "compiler" that builds nothing
    (tmp_path / "cc").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    found.unlink()
    with caplog.at_level("WARNING", "edgelite.engine.kernels"):
        assert build.build(cfg) is None
    [record] = caplog.records
    assert "\n" not in record.getMessage()
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    caplog.clear()
    with caplog.at_level("WARNING", "edgelite.engine.kernels"):
        assert build.build(cfg) is None
    [record] = caplog.records
    assert "no C compiler" in record.getMessage() and "pkg install clang" in record.getMessage()
    monkeypatch.setenv("CC", str(tmp_path / "cc"))
    (tmp_path / "cc").write_text("#!/bin/sh\necho 'cc: internal error' >&2\nexit 1\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    caplog.clear()
    with caplog.at_level("WARNING", "edgelite.engine.kernels"):
        assert build.build(cfg) is None
    [record] = caplog.records
    assert "cc: internal error" in record.getMessage() and "\n" not in record.getMessage()
