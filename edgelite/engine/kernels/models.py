"""One-operator ONNX models of the kernel library's operators (protobuf written by hand:
phones have no `onnx` package): what the library's check, the tests and the benchmarks run."""

from __future__ import annotations

from edgelite.engine.kernels.twins import ZERO6, ZERO8
from edgelite.engine.onnxgraph import (
    FLOAT,
    FLOAT16,
    GRAPH_INPUT,
    GRAPH_NAME,
    GRAPH_NODE,
    GRAPH_OUTPUT,
    INT8,
    INT64,
    MODEL_GRAPH,
    MODEL_IR_VERSION,
    UINT8,
    encode,
    make_node,
    make_value_info,
    with_opset,
)

DOMAIN = "edgelite"  # the operators' ONNX domain (ops.c registers it)


def one_node_model(node: bytes, inputs: list[bytes], outputs: list[bytes]) -> bytes:
    """A model of one node (its graph's inputs and outputs as value infos), in ONNX's opset
    17 and the operators' domain."""
    graph = encode([(GRAPH_NODE, 2, node), (GRAPH_NAME, 2, b"check"),
                    *((GRAPH_INPUT, 2, i) for i in inputs), *((GRAPH_OUTPUT, 2, o) for o in outputs)])
    model = encode([(MODEL_IR_VERSION, 0, 8), (MODEL_GRAPH, 2, graph)])
    return with_opset(with_opset(model, "", 17), DOMAIN, 1)


def attend_model(op: str, heads: int, kv: int, d: int, cap: int, window: int) -> bytes:
    """A model of one attend.c operator (protobuf by hand: phones have no `onnx` package)."""
    kv_elem, row = {"Attend": (FLOAT, d), "Attend16": (FLOAT16, d), "Attend8": (INT8, d + 2)}[op]
    node = make_node(
        op,
        ["q", "k_new", "v_new", "k", "v", "total", "cos", "sin"],
        ["out", "k_out", "v_out"],
        "attend",
        DOMAIN,
        num_heads=heads,
        kv_num_heads=kv,
        local_window_size=window,
        scale=d**-0.5,
    )
    return one_node_model(node, [
        make_value_info("q", FLOAT, [1, "n", heads * d]),
        make_value_info("k_new", FLOAT, [1, "n", kv * d]),
        make_value_info("v_new", FLOAT, [1, "n", kv * d]),
        make_value_info("k", kv_elem, [1, kv, cap, row]),
        make_value_info("v", kv_elem, [1, kv, cap, row]),
        make_value_info("total", INT64, [1]),
        make_value_info("cos", FLOAT, [cap, "half"]),
        make_value_info("sin", FLOAT, [cap, "half"]),
    ], [
        make_value_info("out", FLOAT, [1, "n", heads * d]),
        make_value_info("k_out", kv_elem, [1, kv, cap, row]),
        make_value_info("v_out", kv_elem, [1, kv, cap, row]),
    ])


def matmul_model(op: str, k: int, n: int, threads: int = 1) -> bytes:
    """A model of one matmul.c operator: (m, k) by n columns (MatMul6: zero point ZERO6)."""
    if op == "MatMul8":
        weights = [
            make_value_info("codes", UINT8, [n // 4, k // 64, 4, 64]),
            make_value_info("scales", FLOAT, [n // 4, k // 64, 4, 2]),
        ]
        node = make_node(
            op, ["a", "codes", "scales"], ["y"], "matmul", DOMAIN, K=k, N=n, zero=ZERO8, threads=threads
        )
    elif op == "MatMul4":
        b4 = -(-k // 128)
        weights = [
            make_value_info("codes", UINT8, [n // 4, b4, 4, 64]),
            make_value_info("scales", FLOAT, [n // 4, b4, 4, 4]),
        ]
        node = make_node(op, ["a", "codes", "scales"], ["y"], "matmul", DOMAIN, K=k, N=n, threads=threads)
    elif op == "MatMul4K":
        s = k // 256
        weights = [
            make_value_info("codes", UINT8, [n // 4, 2 * s, 4, 64]),
            make_value_info("mult", UINT8, [n // 4, s, 2, 4, 8]),
            make_value_info("base", FLOAT16, [n // 4, s, 8]),
        ]
        node = make_node(
            op, ["a", "codes", "mult", "base"], ["y"], "matmul", DOMAIN, K=k, N=n, threads=threads
        )
    else:
        s = k // 256
        weights = [
            make_value_info("codes", UINT8, [n // 4, s, 4, 192]),
            make_value_info("mult", INT8, [n // 4, s, 4, 16]),
            make_value_info("base", FLOAT, [n // 4, s, 4]),
        ]
        node = make_node(
            op, ["a", "codes", "mult", "base"], ["y"], "matmul", DOMAIN, K=k, N=n, zero=ZERO6, threads=threads
        )
    return one_node_model(node, [make_value_info("a", FLOAT, ["m", k]), *weights],
                          [make_value_info("y", FLOAT, ["m", n])])


def norm_model(skip: bool, d: int, eps: float) -> bytes:
    """A model of one Norm (SkipNorm with `skip`: its sum as a second output) over (n, d) rows."""
    ins = ["x", "skip", "g"] if skip else ["x", "g"]
    outs = ["y", "sum"] if skip else ["y"]
    node = make_node("SkipNorm" if skip else "Norm", ins, outs, "norm", DOMAIN, epsilon=eps)
    return one_node_model(node, [make_value_info(i, FLOAT, [d] if i == "g" else ["n", d]) for i in ins],
                          [make_value_info(o, FLOAT, ["n", d]) for o in outs])
