"""Tensors on the wire: {dtype, shape, data}, checked against the limits before any use.

On receipt a tensor is a zero-copy numpy view of the frame's bytes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from edgelite.config import WireLimits
from edgelite.errors import ProtocolError

DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32}
ITEMSIZE = {k: np.dtype(v).itemsize for k, v in DTYPES.items()}


def encode_tensor(a: np.ndarray) -> dict[str, Any]:
    a = np.ascontiguousarray(a)
    if a.dtype.name not in DTYPES:
        raise ProtocolError(f"dtype {a.dtype.name} cannot be sent; known: {', '.join(DTYPES)}")
    data = a.data.cast("B") if a.size else b""  # (a view with a zero in its shape cannot be cast)
    return {"dtype": a.dtype.name, "shape": list(a.shape), "data": data}


def decode_tensor(obj: Any, limits: WireLimits, name: str = "tensor") -> np.ndarray:
    """Zero-copy view of a received tensor, after checking dtype, shape and length."""
    if type(obj) is not dict or len(obj) != 3:
        raise ProtocolError(f"{name}: expected a tensor {{dtype, shape, data}}")
    dtype, shape, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
    if type(dtype) is not str or dtype not in DTYPES:
        raise ProtocolError(f"{name}: unknown dtype {str(dtype)[:40]!r}; known: {', '.join(DTYPES)}")
    if type(shape) is not list or len(shape) > limits.max_tensor_dims:
        raise ProtocolError(f"{name}: shape must be a list of at most {limits.max_tensor_dims} "
                            f"sizes, got {str(shape)[:80]}")
    for d in shape:
        if type(d) is not int or d < 0:
            raise ProtocolError(f"{name}: bad shape {str(shape)[:80]}")
    n = math.prod(shape)
    if n > limits.max_tensor_elements or max(shape, default=0) > limits.max_tensor_elements:
        raise ProtocolError(f"{name}: shape {str(shape)[:80]} exceeds the limit of "
                            f"{limits.max_tensor_elements} elements")
    if type(data) is not bytes or len(data) != n * ITEMSIZE[dtype]:
        got = len(data) if type(data) is bytes else type(data).__name__
        raise ProtocolError(f"{name}: shape {shape} x {dtype} needs {n * ITEMSIZE[dtype]} bytes, "
                            f"got {got}")
    return np.frombuffer(data, DTYPES[dtype]).reshape(shape)
