"""Building the kernel library for this device: its compile units (cpu.py: the reference, the
glue and the best path this CPU runs) compiled side by side with the first C compiler that
works, linked, checked in a child process (check.py) and kept in the machine's build cache,
named by the sources, the compiler, the units and their flags (so a CPU with other features
builds its own). A process builds at most once, in a thread of its own (`start`: a node starts
it as it starts; a range that loads waits for it, `library`).

Where no compiler works, or the check fails (a crash there is a failed check: the process that
asked lives), the operators fall back to onnxruntime's (engine/passes/attention.py, engine/passes/linear.py
leave the graph), slower at long contexts, and it says so once.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from edgelite import paths
from edgelite.config import RuntimeConfig
from edgelite.engine.kernels import cpu

log = logging.getLogger(__name__)
COMPILERS = ("cc", "clang", "gcc")  # tried in this order after $CC
PREFIX = "edgelite-"  # the libraries' names in the cache: edgelite-<path>-<hash>.so
# what a check is (a stamp names them: a new check checks an old library again)
CHECKS = (Path(__file__).with_name("check.py"), Path(__file__).with_name("twins.py"),
          Path(__file__).with_name("models.py"))
PREBUILT = "EDGELITE_KERNEL_LIBRARY"  # a library to use as it is (still checked) instead of a build
OK_SUFFIX = ".ok"  # beside a library that passed its check: its sha256, onnxruntime's version, the check's
_running: set[subprocess.Popen] = set()  # compilers running now (killed when the process exits)
_running_lock = threading.Lock()


@atexit.register
def _kill_compilers() -> None:
    with _running_lock:
        for proc in _running:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)


def sources() -> list[Path]:
    """Every file the library is built from (src/*.c, src/*.h)."""
    return sorted(p for p in cpu.SRC.iterdir() if p.suffix in (".c", ".h"))


def compilers() -> list[str]:
    names = [os.environ["CC"]] if os.environ.get("CC") else []
    return [p for p in (shutil.which(n) for n in (*names, *COMPILERS)) if p]


class Build:
    """One library build: the units for a CPU (cpu.units), compiled side by side, the best path
    that compiles kept (a compiler too old for a path's flags leaves that path out)."""

    def __init__(
        self,
        cc: str,
        family: str,
        have: frozenset[str],
        every: bool = False,
        folder: Path | None = None,
        timeout_s: float = 180.0,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.cc, self.family, self.have, self.every = cc, family, have, every
        self.folder = folder or paths.cache() / "kernels"
        self.timeout_s, self.extra = timeout_s, extra
        self.units = cpu.units(family, have, every)

    def target(self, units: list[cpu.Unit]) -> Path:
        """Where a library of these units is kept: named by what it is built from."""
        tag = hashlib.sha256()
        for p in sources():
            tag.update(p.name.encode() + b"\0" + p.read_bytes())
        tag.update(self.cc.encode() + b"\0" + self.family.encode() + b"\0" + " ".join(self.extra).encode())
        for u in units:
            tag.update(f"{u.source} {' '.join(u.flags)}\n".encode())
        best = units[-1].path if len(units) > 2 else "ref"
        return self.folder / f"{PREFIX}{best}-{tag.hexdigest()[:16]}.so"

    def run(self) -> tuple[Path | None, str]:
        """The library built (or found), and what went wrong where none could be built."""
        base, paths_ = self.units[:2], self.units[2:]
        if self.target(self.units).is_file():
            return self.target(self.units), ""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return None, f"cannot write in {self.folder}: {exc}"
        with tempfile.TemporaryDirectory(dir=self.folder, prefix=".build-") as tmp:
            objects, error = self._compile(base + paths_, Path(tmp))
            if any(u not in objects for u in base):
                return None, error
            kept = (
                [u for u in paths_ if u in objects]
                if self.every
                else [u for u in paths_ if u in objects][-1:]
            )
            if not kept and paths_:  # the best path did not compile: the next ones, best first
                for u in reversed(cpu.units(self.family, self.have, every=True)[2:-1]):
                    more, error = self._compile([u], Path(tmp))
                    if more:
                        objects.update(more)
                        kept = [u]
                        break
            units = [*base, *kept]
            target = self.target(units)
            if target.is_file():
                return target, ""
            linked = Path(tmp) / "lib.so"
            error = self._link([objects[u] for u in units], linked)
            if error:
                return None, error
            os.replace(linked, target)  # (atomic: other processes see the whole library or none)
            return target, ""

    def _compile(self, units: list[cpu.Unit], tmp: Path) -> tuple[dict[cpu.Unit, Path], str]:
        """Each unit compiled to an object, side by side; the objects that compiled, and the
        first error otherwise."""
        running: list[tuple[cpu.Unit, Path, subprocess.Popen]] = []
        done: dict[cpu.Unit, Path] = {}
        error = ""
        try:
            for u in units:
                obj = tmp / (u.source + ".o")
                source = str(cpu.SRC / u.source)
                cmd = [self.cc, *cpu.COMMON, *u.flags, *self.extra, "-c", "-o", str(obj), source]
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)  # (its own group: killed whole)
                running.append((u, obj, proc))
                with _running_lock:
                    _running.add(proc)
            end = time.monotonic() + self.timeout_s
            for u, obj, proc in running:
                try:
                    out, _ = proc.communicate(timeout=max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    error = error or f"{Path(self.cc).name} took over {self.timeout_s:.0f} s on {u.source}"
                    continue
                if proc.returncode == 0 and obj.is_file():
                    done[u] = obj
                elif not error:
                    lines = [line for line in out.splitlines() if "error" in line] or out.strip().splitlines()
                    first = lines[0] if lines else f"exit {proc.returncode}, no object written"
                    error = f"{Path(self.cc).name} {u.source}: {first}"
        except OSError as exc:
            error = f"{Path(self.cc).name}: {exc}"
        finally:
            for _, _, proc in running:
                if proc.poll() is None:
                    with contextlib.suppress(OSError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                with _running_lock:
                    _running.discard(proc)
        return done, error

    def _link(self, objects: list[Path], out: Path) -> str:
        cmd = [self.cc, "-shared", *cpu.COMMON, *self.extra, "-o", str(out), *map(str, objects), "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{Path(self.cc).name}: linking: {exc}"
        if done.returncode or not out.is_file():
            lines = (done.stderr or done.stdout).strip().splitlines()
            first = lines[0] if lines else f"exit {done.returncode}, no library written"
            return f"{Path(self.cc).name}: linking: {first}"
        return ""


def checked(library: Path, cfg: RuntimeConfig) -> str | None:
    """None when `library` passes its check (check.py) in a child process (or passed it before:
    its stamp); else why not, in one line. A crash in the check (a wrong-ISA build's SIGILL)
    fails the check and nothing else."""
    try:
        digest = hashlib.sha256(library.read_bytes()).hexdigest()
    except OSError as exc:
        return f"cannot read {library}: {exc}"
    import onnxruntime as ort

    stamp = library.with_name(library.name + OK_SUFFIX)
    checks = hashlib.sha256(b"".join(p.read_bytes() for p in CHECKS)).hexdigest()[:16]
    mark = f"{digest} {ort.__version__} {checks}"
    try:
        if stamp.read_text() == mark:
            return None
    except OSError:
        pass
    cmd = [sys.executable, "-m", "edgelite.engine.kernels.check", str(library), "--threads", str(cfg.threads)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=cfg.kernel_check_s, check=False)
    except subprocess.TimeoutExpired:
        return f"its check took over {cfg.kernel_check_s:.0f} s"
    except OSError as exc:
        return f"its check could not start: {exc}"
    if done.returncode < 0:
        name = (
            signal.Signals(-done.returncode).name
            if -done.returncode in signal.valid_signals()
            else str(-done.returncode)
        )
        return f"its check died with {name} (a path this CPU cannot run?)"
    if done.returncode:
        lines = (done.stdout.strip() or done.stderr.strip() or f"exit {done.returncode}").splitlines()
        return lines[-1]
    try:
        stamp.write_text(mark)
    except OSError as exc:
        log.info(
            "kernel library: cannot mark %s as checked (%s); it is checked again next time", library, exc
        )
    return None


def build(
    cfg: RuntimeConfig,
    every: bool = False,
    family: str | None = None,
    have: frozenset[str] | None = None,
    folder: Path | None = None,
    extra: tuple[str, ...] = (),
) -> Path | None:
    """This device's library, built now if the cache has none that passes its check; None
    (logged once) when none can be built. `every`: each path this CPU runs (the tests)."""
    given = os.environ.get(PREBUILT)
    if given:  # a library built elsewhere (a cross-compiler, the ARM tests): checked, not built
        error = checked(Path(given), cfg)
        if error is None:
            log.info("kernel library: %s (given by %s)", given, PREBUILT)
            return Path(given)
        log.warning("kernel library: %s=%s: %s; using onnxruntime's operators", PREBUILT, given, error)
        return None
    family = family or cpu.machine()
    have = cpu.features(family) if have is None else have
    try:
        src = sources()
    except OSError as exc:
        log.warning(
            "kernel library: cannot read its sources in %s (%s); using onnxruntime's operators", cpu.SRC, exc
        )
        return None
    if not any(p.name == "ops.c" for p in src):
        log.warning(
            "kernel library: %s has no ops.c (an install without the kernel sources); using onnxruntime's "
            "operators",
            cpu.SRC,
        )
        return None
    found = compilers()
    if not found:
        log.warning(
            "kernel library: no C compiler (cc, clang, gcc; Termux: pkg install clang); using onnxruntime's "
            "operators, slower at long contexts"
        )
        return None
    errors = []
    for cc in found:
        for level_have in _fallbacks(family, have):
            started = time.monotonic()
            library, error = Build(cc, family, level_have, every, folder, cfg.kernel_build_s, extra).run()
            if library is None:
                errors.append(error)
                break  # (this compiler cannot build the base: the next one)
            error = checked(library, cfg)
            if error is None:
                log.info(
                    "kernel library: %s (%s, %.1f s)", library.name, Path(cc).name, time.monotonic() - started
                )
                return library
            errors.append(error)
            library.unlink(missing_ok=True)
            log.info("kernel library %s failed its check (%s); trying a lower path", library.name, error)
    log.warning("kernel library: %s; using onnxruntime's operators, slower at long contexts", errors[-1])
    return None


def _fallbacks(family: str, have: frozenset[str]) -> list[frozenset[str]]:
    """The feature sets to try in turn: this CPU's, then each lower path's, then none (the
    reference alone)."""
    units = cpu.units(family, have, every=True)[2:]
    return [have, *(u.needs for u in reversed(units[:-1])), frozenset()] if units else [have]


class Builder:
    """This process's one build, in a thread of its own: started once (`start`), waited for
    by whoever needs the library (`wait`); compilers it runs are killed when it is stopped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._future: Future[Path | None] | None = None
        self._thread: threading.Thread | None = None

    def start(self, cfg: RuntimeConfig) -> Future[Path | None]:
        with self._lock:
            if self._future is None:
                future: Future[Path | None] = Future()
                self._future = future

                def run() -> None:
                    try:
                        future.set_result(build(cfg))
                    except Exception as exc:  # noqa: BLE001 - the library is optional: any failure falls back
                        log.warning("kernel library: %s; using onnxruntime's operators", exc)
                        future.set_result(None)

                self._thread = threading.Thread(target=run, name="kernel-build", daemon=True)
                self._thread.start()
            return self._future

    def started(self) -> bool:
        with self._lock:
            return self._future is not None

    def done(self) -> bool:
        with self._lock:
            return self._future is not None and self._future.done()

    def wait(self, cfg: RuntimeConfig, timeout_s: float | None = None) -> Path | None:
        """The library, waiting up to timeout_s (default: the build's own limit) for the build."""
        future = self.start(cfg)
        try:
            return future.result(
                timeout=cfg.kernel_build_s + cfg.kernel_check_s if timeout_s is None else timeout_s
            )
        except TimeoutError:
            return None

    def reset(self) -> None:
        """Forget the build (tests)."""
        with self._lock:
            self._future = None


BUILDER = Builder()
