"""The kernel library on ARM, proven on this x86 machine under qemu-user: cross-built as phones
build it (engine/kernels/cpu.py's flags; -O1 here, for time: the same bits at any level, and
`slow` builds it at -O3 too), every ARM path (ARMv8.0 NEON, dotprod, i8mm)
runs the check cases (tests/kernel_cases.py) on the CPU models phones have, cortex-a72
(ARMv8.0), cortex-a76 (dotprod) and max (dotprod, i8mm; with and without SVE), and gives the x86
reference's digest; a path the CPU lacks is refused, never a SIGILL; the build holds SDOT, SMMLA
and no SVE instruction; an aarch64 Python (Debian's python3.11 with PyPI's aarch64 onnxruntime
1.29.0: scripts/arm_python.sh) registers the library, passes its check, and a layer range whose
every product is edgelite's gives the x86 build's bits. Needs qemu-user, gcc-aarch64-linux-gnu
and binutils-aarch64-linux-gnu (.ci/run installs them); skipped without them."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import kernel_cases as kc
import kernel_layers
import pytest

from edgelite.engine.kernels import build, cpu

pytestmark = pytest.mark.e2e
REPO = Path(__file__).parent.parent
CC = "aarch64-linux-gnu-gcc"
SYSROOT = "/usr/aarch64-linux-gnu"
ALL = frozenset({"asimd", "asimddp", "i8mm"})
# the paths each CPU model runs (a path it lacks: refused with exit 3, never run)
CPUS = {"cortex-a72": {"ref", "neon"}, "cortex-a76": {"ref", "neon", "dotprod"},
        "max,sme=off": {"ref", "neon", "dotprod", "i8mm"}, "max,sve=off": {"ref", "neon", "dotprod", "i8mm"}}
SVE = re.compile(r"\bz[0-9]+\.[bhsdq]\b|\bp[0-9]+/[zm]\b|\b(ptrue|whilelo|whilelt|ld1w|st1w)\b")


class Arm:
    """The cross-built library (every ARM path, production flags) and the case driver; the
    aarch64 Python is made beside them, meanwhile."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.library: Path | None = None
        self.error = ""
        self.python: Path | None = None
        self.python_error = ""
        self._python = threading.Thread(target=self._make_python)
        self._python.start()
        self.library, self.error = build.Build(CC, "arm", ALL, every=True, folder=folder / "lib",
                                               extra=("-O1",)).run()
        self.driver = folder / "kernel_driver"
        subprocess.run([CC, "-O1", "-o", str(self.driver), str(REPO / "tests" / "kernel_driver.c"), "-ldl"],
                       check=True, capture_output=True, timeout=120)

    def _make_python(self) -> None:
        done = subprocess.run(["bash", str(REPO / "scripts" / "arm_python.sh"), str(self.folder / "root")],
                              capture_output=True, text=True, timeout=600)
        if done.returncode == 0:
            self.python = Path(done.stdout.strip().splitlines()[-1])
        else:
            self.python_error = (done.stderr.strip().splitlines() or ["?"])[-1]

    def emulated_python(self) -> Path:
        self._python.join()
        if self.python is None:
            pytest.skip(f"no aarch64 Python could be made here: {self.python_error}")
        return self.python

    def run_python(self, cpu_model: str, *args: str, env: dict[str, str] | None = None,
                   timeout: float = 600) -> subprocess.CompletedProcess:
        python = self.emulated_python()
        root = python.parent.parent.parent
        path = f"{REPO}:{root}/usr/lib/python3.11/site-packages:{REPO / 'tests'}"
        return subprocess.run(["qemu-aarch64", "-cpu", cpu_model, "-L", str(root), str(python), *args],
                              capture_output=True, text=True, timeout=timeout,
                              env={"PYTHONPATH": path, "HOME": str(self.folder), **(env or {})})


@pytest.fixture(scope="module")
def arm(tmp_path_factory: pytest.TempPathFactory) -> Arm:
    missing = [t for t in ("qemu-aarch64", CC, "aarch64-linux-gnu-objdump") if not shutil.which(t)]
    if missing or not Path(SYSROOT).is_dir():
        pytest.skip(f"no {', '.join(missing) or SYSROOT} here: apt-get install qemu-user "
                    f"gcc-aarch64-linux-gnu binutils-aarch64-linux-gnu")
    made = Arm(tmp_path_factory.mktemp("arm"))
    assert made.library is not None, made.error
    return made


def test_every_arm_path_gives_the_x86_reference_bits_on_each_cpu(arm: Arm, kernel_paths: Path,
                                                                 tmp_path: Path) -> None:
    cases = kc.products(), kc.steps(), kc.norms()
    kc.write_cases(tmp_path / "cases", *cases)
    lib = kc.Library(kernel_paths)
    lib.use("ref")
    want = [lib.product(c) for c in cases[0]]
    for s in cases[1]:
        want += lib.step(s) + lib.step(s, one_by_one=True)
    for c in cases[2]:
        want += lib.norm(c)
    digest = kc.digest(want)

    def run(model: str, path: str) -> tuple[str, str, subprocess.CompletedProcess, str]:
        out = tmp_path / f"out-{model}-{path}"
        cmd = ["qemu-aarch64", "-cpu", model, "-L", SYSROOT, str(arm.driver), str(arm.library), path,
               str(tmp_path / "cases"), str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        return model, path, done, kc.digest(kc.read_outputs(out, *cases)) if done.returncode == 0 else ""

    with ThreadPoolExecutor(2) as pool:  # (each emulated process keeps one core busy)
        runs = list(pool.map(lambda mp: run(*mp), [(m, p) for m in CPUS for p in ("ref", "neon", "dotprod",
                                                                                   "i8mm")]))
    for model, path, done, got in runs:
        if path not in CPUS[model]:
            assert done.returncode == 3, (model, path, done.returncode, done.stderr)
        else:
            assert done.returncode == 0, (model, path, done.returncode, done.stderr)
            assert got == digest, (model, path)


def _holds_sdot_and_smmla_and_no_sve(library: Path, tmp_path: Path) -> None:
    text = subprocess.run(["aarch64-linux-gnu-objdump", "-d", str(library)], capture_output=True, text=True,
                          check=True, timeout=120).stdout
    counts = {op: len(re.findall(rf"\t{op}\t", text)) for op in ("sdot", "smmla", "usmmla")}
    assert all(counts.values()), counts
    assert not SVE.search(text), SVE.search(text)
    # (the same search finds what a build with SVE holds)
    (tmp_path / "loop.c").write_text("float f(const float *a, const float *b, int n) {\n  float s = 0;\n"
                                     "  for (int i = 0; i < n; i++) s += a[i] * b[i];\n  return s;\n}\n")
    subprocess.run([CC, "-O3", "-ffast-math", "-march=armv8.2-a+sve", "-c", "-o", str(tmp_path / "loop.o"),
                    str(tmp_path / "loop.c")], check=True, timeout=60)
    sve = subprocess.run(["aarch64-linux-gnu-objdump", "-d", str(tmp_path / "loop.o")], capture_output=True,
                         text=True, check=True).stdout
    assert SVE.search(sve)
    phone = cpu.units("arm", frozenset({"asimd", "asimddp", "i8mm"}))  # (Snapdragon 8 Gen 1-3: no SVE)
    assert not any("sve" in f or "native" in f for u in phone for f in u.flags)


def test_the_arm_build_holds_sdot_and_smmla_and_no_sve(arm: Arm, tmp_path: Path) -> None:
    assert arm.library is not None
    _holds_sdot_and_smmla_and_no_sve(arm.library, tmp_path)


@pytest.mark.slow
def test_a_phones_own_build_at_its_own_level_holds_no_sve(arm: Arm, tmp_path: Path) -> None:
    """The library a Snapdragon 8 Gen 1-3 builds (ops, ref, i8mm; -O3, where GCC vectorizes
    loops: where SVE would show if the flags let it)."""
    library, error = build.Build(CC, "arm", ALL, folder=tmp_path / "lib").run()
    assert library is not None, error
    _holds_sdot_and_smmla_and_no_sve(library, tmp_path)


def test_an_aarch64_python_registers_the_library_and_a_layer_range_gives_x86s_bits(
        arm: Arm, ggufs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from edgelite.engine import kernels
    from edgelite_export import build as export

    # every product in edgelite's operators on this x86 CPU too (on AVX2 the K-quants' are the
    # reference's: the same bits, slower than MatMulNBits, which would be onnxruntime's bits)
    monkeypatch.setattr(kernels, "matmul_kinds", lambda library: frozenset(kernels.MATMUL_OPS))

    assert arm.library is not None
    done = arm.run_python("max,sme=off", "-m", "edgelite.engine.kernels.check", str(arm.library))
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    version = arm.run_python("max,sme=off", "-c", "import onnxruntime; print(onnxruntime.__version__)")
    assert version.stdout.strip() == "1.29.0", version
    # (its check passed in that Python: what build.checked marks; an emulated process starts no
    # other emulated one)
    digest = hashlib.sha256(arm.library.read_bytes()).hexdigest()
    checks = hashlib.sha256(b"".join(p.read_bytes() for p in build.CHECKS)).hexdigest()[:16]
    arm.library.with_name(arm.library.name + build.OK_SUFFIX).write_text(f"{digest} 1.29.0 {checks}")
    model = export.run(str(ggufs["Q4_K+Q6_K"]), tmp_path / "k", export.Options(steps=4)).out
    x86 = kernel_layers.main(model).split()
    for path in ("i8mm", "neon"):
        done = arm.run_python("max,sme=off", str(REPO / "tests" / "kernel_layers.py"), str(model),
                              env={build.PREBUILT: str(arm.library), "EDGELITE_KERNEL_PATH": path})
        assert done.returncode == 0, done.stderr[-2000:]
        got = done.stdout.split()
        assert f"MatMul4K={path}" in got, got
        assert got[0] == x86[0], (path, got, x86)
