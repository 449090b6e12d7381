"""Where a client keeps its files: $EDGELITE_HOME, else ~/.edgelite."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("EDGELITE_HOME") or Path.home() / ".edgelite")
