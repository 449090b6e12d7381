"""The kernel library's paths (engine/kernels/src: the reference and one per ISA family) give the
reference's bits on every check case (tests/kernel_cases.py): one digest for all of them; the
reference is near the numpy twins; each row alone is the same as in a chunk; the library this
device builds for itself (-O3) gives the test build's bits (-O1); tests/kernel_driver.c, which
runs the cases on other ISAs under qemu (test_arm.py), gives the in-process results here."""

from __future__ import annotations

import subprocess
from pathlib import Path

import kernel_cases as kc
import numpy as np
import pytest

from edgelite.config import RuntimeConfig
from edgelite.engine import kernels
from edgelite.engine.kernels import build, twins

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def cases() -> tuple[list[kc.Product], list[kc.Step], list[kc.Norm]]:
    return kc.products(), kc.steps(), kc.norms()


def _run(lib: kc.Library, path: str, cases: tuple) -> list[np.ndarray]:
    lib.use(path)
    out = [lib.product(c) for c in cases[0]]
    for s in cases[1]:
        out += lib.step(s) + lib.step(s, one_by_one=True)
    for c in cases[2]:
        out += lib.norm(c)
    return out


def test_every_path_gives_the_reference_bits(kernel_paths: Path, cases) -> None:
    lib = kc.Library(kernel_paths)
    found = lib.paths()
    assert found[0] == "ref" and len(found) >= 2, f"no vector path was built here: {found}"
    ref = _run(lib, "ref", cases)
    for path in found[1:]:
        got = _run(lib, path, cases)
        diff = [i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if not np.array_equal(a, b)]
        assert not diff, f"{path} differs from the reference in {len(diff)} outputs, the first #{diff[0]}"
        assert kc.digest(got) == kc.digest(ref)


def test_the_reference_is_near_numpy_and_rows_alone_are_rows_in_a_chunk(kernel_paths: Path, cases) -> None:
    lib = kc.Library(kernel_paths)
    lib.use("ref")
    for c in cases[0]:
        got = lib.product(c)
        assert np.allclose(got, c.want, rtol=1e-4, atol=1e-4 * np.abs(c.want).max()), c.op
        alone = np.concatenate([lib.product(c, slice(r, r + 1)) for r in range(c.a.shape[0])])
        assert np.array_equal(alone, got), (c.op, c.a.shape)
    for s in cases[1]:
        chunk, k, v = lib.step(s)
        one = lib.step(s, one_by_one=True)
        assert all(np.array_equal(x, y) for x, y in zip(one, (chunk, k, v), strict=True)), (
            s.kind,
            s.heads,
            s.d,
        )
        n = s.q.shape[0]
        turned = twins.turned(
            s.q.reshape(n, s.heads, s.d), s.cos[s.total - n : s.total], s.sin[s.total - n : s.total]
        )
        want = twins.reference(
            turned.reshape(1, n, -1),
            twins.values(k)[None],
            twins.values(v)[None],
            s.total,
            s.heads,
            s.window if s.window > 0 else 1 << 30,
        )[0]
        tol = 1e-4 if s.kind != 2 else twins.INT8_TOLERANCE * np.abs(twins.values(v)).max()
        assert np.allclose(chunk, want, atol=tol), (s.kind, s.heads, s.d, s.total, np.abs(chunk - want).max())
    for c in cases[2]:
        got = lib.norm(c)
        assert np.allclose(got[0], twins.norm(c.x, c.g, c.eps, c.skip), rtol=1e-5, atol=1e-5), c.x.shape
        assert c.skip is None or np.array_equal(got[1], c.x + c.skip)


def test_the_library_built_here_gives_the_test_builds_bits(kernel_paths: Path, cases) -> None:
    built = kernels.library(RuntimeConfig(threads=1))
    assert built is not None, "the kernel library could not be built here"
    ours = kc.Library(built)
    best = ours.paths()[-1]
    assert kc.digest(_run(ours, best, cases)) == kc.digest(_run(kc.Library(kernel_paths), "ref", cases))


def test_the_driver_gives_the_results_in_this_process(kernel_paths: Path, cases, tmp_path: Path) -> None:
    driver = tmp_path / "kernel_driver"
    subprocess.run(
        [
            build.compilers()[0],
            "-O1",
            "-o",
            str(driver),
            str(Path(__file__).with_name("kernel_driver.c")),
            "-ldl",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    prods, stps, nrms = cases[0][:20], cases[1][:12], cases[2]
    kc.write_cases(tmp_path / "cases", prods, stps, nrms)
    done = subprocess.run(
        [str(driver), str(kernel_paths), "ref", str(tmp_path / "cases"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    got = kc.read_outputs(tmp_path / "out", prods, stps, nrms)
    assert kc.digest(got) == kc.digest(_run(kc.Library(kernel_paths), "ref", (prods, stps, nrms)))
    unknown = subprocess.run(
        [str(driver), str(kernel_paths), "sve", str(tmp_path / "cases"), str(tmp_path / "o")],
        capture_output=True,
        timeout=60,
    )
    assert unknown.returncode == 3
