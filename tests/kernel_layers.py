"""A layer range's outputs for a fixed input, printed as a digest: run by the x86 Python and by
an aarch64 Python under qemu-user (tests/test_arm.py), whose kernel library is the ARM build
(EDGELITE_KERNEL_LIBRARY). python kernel_layers.py MODEL_DIR"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np

from edgelite import manifest as mf
from edgelite.config import RuntimeConfig
from edgelite.engine import kernels
from edgelite.engine.layers import LayerRange, export_files


def main(model: Path) -> str:
    m = mf.load(model)
    cfg = RuntimeConfig(threads=1, verify_hashes=False)
    layers = LayerRange(m, 0, m.num_layers - 1, cfg, export_files(m, verify=False))
    rng = np.random.default_rng(7)
    slot = layers.pool.acquire()
    digest = hashlib.sha256()
    for n in (5, 1, 1, 3):  # a prompt chunk, two decode steps, a verification step
        out = layers.run(slot, rng.standard_normal((1, n, m.hidden_size)).astype(np.float32))
        digest.update(np.ascontiguousarray(out).tobytes())
    layers.pool.release(slot)
    return f"{digest.hexdigest()} {kernels.status(cfg)}"


if __name__ == "__main__":
    sys.stdout.write(main(Path(sys.argv[1])) + "\n")
