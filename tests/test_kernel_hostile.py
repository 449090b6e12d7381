"""The kernel library defends itself (issue 62): hostile shapes and attributes (tests/kernel_hostile.py)
end in an onnxruntime error naming the operator, never a crash, a wrong write or silent zeros;
the AddressSanitizer build of the library runs the same cases without a report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kernel_hostile
import pytest

from edgelite.engine.kernels import build, cpu

pytestmark = pytest.mark.engine
HERE = Path(__file__).parent


def test_hostile_shapes_fail_naming_the_operator_and_a_good_call_still_runs(kernel_paths: Path) -> None:
    assert kernel_hostile.run(kernel_paths) == []


def test_the_addresssanitizer_build_runs_the_hostile_cases_clean(tmp_path: Path) -> None:
    cc = build.compilers()[0]
    runtime = [subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True,
                              check=True).stdout.strip() for name in ("libasan.so", "libstdc++.so")]
    if not all(Path(p).is_absolute() and Path(p).exists() for p in runtime):
        pytest.skip(f"{Path(cc).name} has no AddressSanitizer runtime here")
    family = cpu.machine()
    library, error = build.Build(cc, family, cpu.features(family), folder=tmp_path,
                                 extra=("-O1", "-fsanitize=address", "-fno-omit-frame-pointer")).run()
    assert library is not None, error
    # (libstdc++ preloaded too: ASan's throw interceptor needs it before onnxruntime's C++)
    env = {**os.environ, "LD_PRELOAD": " ".join(runtime), "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0",
           "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    done = subprocess.run([sys.executable, str(HERE / "kernel_hostile.py"), str(library)], env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0 and "AddressSanitizer" not in done.stderr, done.stdout + done.stderr[-3000:]
    assert f"{len(kernel_hostile.cases())} cases, 0 wrong" in done.stdout
