"""`--json` output that is JSON: a measurement that is not a number (NaN, infinity: a link
not measured, a figure with nothing behind it) is written as null."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (maps, lists and tuples walked)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def dumps(value: Any) -> str:
    return json.dumps(finite(value), allow_nan=False)
