"""What a range of layers holds, as the exporter measured it (exporter/resident.py): each
layer's own part and the range's once (its RoPE tables, a session's state, the process's
first load), checked against ranges of 1, 10 and all 30 layers of SmolLM2 loaded in a fresh
process (issue 66, item 4: each layer used to carry the range's part, so 30 layers were counted
at twice what they hold)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgelite import manifest as mf
from edgelite.config import RuntimeConfig
from edgelite.engine.passes import linear

pytestmark = pytest.mark.engine
MIB = 1 << 20
# the growth of a fresh process's resident set when layers first..last load (onnxruntime's
# one-time state with them, as in a node that loads its range), and one step run through them
GROWTH = """
import json, sys
import numpy as np
from edgelite import manifest as mf
from edgelite.config import RuntimeConfig
from edgelite.engine.layers import LayerRange, export_files
from edgelite.engine.profile import resident_bytes
m = mf.load(sys.argv[1]); first, last = int(sys.argv[2]), int(sys.argv[3])
cfg, files = RuntimeConfig(threads=1, verify_hashes=False), export_files(mf.load(sys.argv[1]), verify=False)
h = np.zeros((1, 1, m.hidden_size), np.float32)
before = resident_bytes()
r = LayerRange(m, first, last, cfg, files)
r.run(r.pool.acquire(), h)
print(json.dumps(resident_bytes() - before))
"""


def test_ranges_hold_what_the_manifest_counts(smollm2) -> None:
    model = Path(smollm2[0])
    m = mf.load(model)
    narrow = linear.narrow(RuntimeConfig(threads=1), m)
    assert m.range_on(narrow) > 0 and all(e.resident_on(narrow) > 0 for e in m.layers)
    for first, last in ((0, 0), (0, 9), (0, m.num_layers - 1)):
        out = subprocess.run([sys.executable, "-c", GROWTH, str(model), str(first), str(last)],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        grew, counted = json.loads(out.stdout), m.resident(first, last, narrow)
        assert 0.8 * counted - 2 * MIB <= grew <= 1.25 * counted + 2 * MIB, (
            first, last, grew / MIB, counted / MIB)
