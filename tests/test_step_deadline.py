"""A step has a deadline (issue 62, engine/deadline.py): a run far past what its range's steps
take is cancelled through onnxruntime's RunOptions.terminate, with one line naming the range
and the deadline; the same session runs again afterwards, and steps within their deadline are
untouched."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgelite import manifest as mf
from edgelite.config import RuntimeConfig
from edgelite.engine import session
from edgelite.engine.deadline import WATCHDOG, StepClock, StepDeadlineExceeded, run_guarded
from edgelite.engine.layers import LayerRange, export_files


def slow_session(products: int = 400, width: int = 768) -> tuple[ort.InferenceSession, ort.IOBinding]:
    """A chain of `products` (width x width) products: seconds on one thread."""
    w = numpy_helper.from_array(np.full((width, width), 1.0 / width, np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"y{i - 1}", "w"], [f"y{i}"])
             for i in range(products)]
    square = [width, width]
    last = f"y{products - 1}"
    graph = helper.make_graph(nodes, "slow", [helper.make_tensor_value_info("x", TensorProto.FLOAT, square)],
                              [helper.make_tensor_value_info(last, TensorProto.FLOAT, square)], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    opts = session.options(RuntimeConfig(threads=1), Path("."))  # (the process's pool, if it has one)
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    made = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    io = made.io_binding()
    x = np.ones((width, width), np.float32)
    io.bind_cpu_input("x", x)
    io.bind_output(f"y{products - 1}", "cpu")
    io.keep = x  # (the bound input lives as long as the binding)
    return made, io


@pytest.mark.engine
def test_a_run_past_its_deadline_is_cancelled_and_the_session_runs_again() -> None:
    run, io = slow_session()
    options = ort.RunOptions()
    t0 = time.perf_counter()
    run_guarded([(run, io)], options, 60.0, "the chain")  # (its whole time, within the deadline)
    whole = time.perf_counter() - t0
    assert whole > 1.0, f"the chain took {whole:.2f} s: too short to cancel in the middle"
    t0 = time.perf_counter()
    with pytest.raises(StepDeadlineExceeded) as caught:
        run_guarded([(run, io)], options, 0.2, "the chain")
    took = time.perf_counter() - t0
    assert took < min(1.0, whole / 2), f"cancelled after {took:.2f} s (the whole run takes {whole:.2f} s)"
    assert str(caught.value) == "the chain: the step ran past its deadline of 0.2 s and was cancelled"
    run_guarded([(run, io)], options, 60.0, "the chain")  # (the same options run again)
    assert np.isfinite(io.copy_outputs_to_cpu()[0]).all()


@pytest.mark.unit
def test_the_watchdog_fires_only_past_the_due_time_and_the_clock_follows_the_steps() -> None:
    options = ort.RunOptions()
    with WATCHDOG.guard(options, 0.15) as g:
        time.sleep(0.05)
        assert not g.fired and not options.terminate
        time.sleep(0.3)
        assert g.fired and options.terminate
    options.terminate = False
    with WATCHDOG.guard(options, 30.0) as far, WATCHDOG.guard(ort.RunOptions(), 0.05) as near:
        time.sleep(0.2)  # (a sooner deadline wakes the thread that waited for the later one)
        assert near.fired and not far.fired
    clock = StepClock(floor_s=30.0, factor=20.0)
    assert clock.deadline(512) == 30.0  # (no history: the floor)
    clock.record(1, 0.010)
    clock.record(1, 0.005)  # (the fastest kept)
    clock.record(64, 0.064)
    assert clock.deadline(1) == 30.0
    assert clock.deadline(512) == pytest.approx(20.0 * 0.005 * 512) or clock.deadline(512) == 30.0
    assert clock.deadline(8192) == pytest.approx(20.0 * 0.005 * 8192)  # (the slowest per-row rate)


@pytest.mark.engine
def test_a_range_whose_step_runs_past_its_deadline_fails_that_step_only(exported: dict[str, Path]) -> None:
    m = mf.load(exported["llama"])
    hidden = np.random.default_rng(0).standard_normal((1, 3, m.hidden_size)).astype(np.float32)
    strict = LayerRange(m, 0, m.num_layers - 1, RuntimeConfig(threads=1, step_deadline_s=0.0,
                                                              step_deadline_factor=0.0), export_files(m))
    slot = strict.pool.acquire()
    says = f"layers 0-{m.num_layers - 1}: the step ran past its deadline"
    with pytest.raises(StepDeadlineExceeded, match=says):
        strict.run(slot, hidden)
    strict.close()
    layers = LayerRange(m, 0, m.num_layers - 1, RuntimeConfig(threads=1), export_files(m))
    slot = layers.pool.acquire()
    assert np.isfinite(layers.run(slot, hidden)).all()
    layers.close()
