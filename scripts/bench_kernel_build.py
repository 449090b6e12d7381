"""How long a device waits for its kernel library (engine/kernels), and how soon a fresh node
answers (issue 60).

Each round, with an empty kernel cache: (1) the library this CPU gets (build.Build: the base
units and this CPU's path), compiled cold and timed; (2) every path of this family at once (what
CI's path tests build); (3) an `edgelite node` started on that empty cache, probed with
`edgelite probe --nodes ... --model DIR --json` at once and again until it answers: the seconds
from the node's start to the probe's answer, what the probe said of its kernel, and when the
node's log says the library is ready (the probing process's own library is built beforehand, in
the usual cache: only the node's is cold). The node builds in the background, so (3) is the
time a client waits whatever the build takes.

    python scripts/bench_kernel_build.py --model models/smollm2-135m [--rounds 3]   (prints JSON)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

READY = re.compile(r"kernel library: (\S+) \((\S+), ([\d.]+) s\)")
PROBE_TIMEOUT_S = 120.0  # one probe's wall-clock limit
READY_TIMEOUT_S = 300.0  # how long to wait for the node's build to end


def cold_build(every: bool) -> float:
    from edgelite.engine.kernels import build, cpu

    family = cpu.machine()
    cc = build.compilers()[0]
    with tempfile.TemporaryDirectory(prefix="bench-kbuild-") as folder:
        started = time.monotonic()
        library, error = build.Build(cc, family, cpu.features(family), every=every, folder=Path(folder)).run()
        took = time.monotonic() - started
    if library is None:
        raise SystemExit(f"cannot build the kernel library: {error}")
    return took


def fresh_node(model: Path, work: Path) -> dict[str, object]:
    from edgelite.cli.localnodes import TOKEN, start_node

    log = work / "node.log"
    before = os.environ.get("EDGELITE_CACHE")
    os.environ["EDGELITE_CACHE"] = str(work / "cache")  # the node's alone: the probe's is warm
    started = time.monotonic()
    try:
        node = start_node(work / "data", log_file=log)
    finally:
        if before is None:
            del os.environ["EDGELITE_CACHE"]
        else:
            os.environ["EDGELITE_CACHE"] = before
    try:
        listening = time.monotonic() - started
        probe = subprocess.run(
            [
                sys.executable,
                "-m",
                "edgelite",
                "probe",
                "--nodes",
                node.addr,
                "--model",
                str(model),
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            env={**os.environ, "EDGELITE_TOKEN": TOKEN},
            check=False,
        )
        answered = time.monotonic() - started
        if probe.returncode:
            raise SystemExit(f"probe failed: {probe.stderr.strip().splitlines()[-1:]}")
        said = [d.get("kernel") for d in json.loads(probe.stdout).get("devices", [])]
        ready = None
        while ready is None and time.monotonic() - started < READY_TIMEOUT_S:
            found = READY.search(log.read_text(errors="replace"))
            ready = time.monotonic() - started if found else None
            time.sleep(0.2)
    finally:
        node.kill()
    return {
        "listening_s": round(listening, 1),
        "probe_answered_s": round(answered, 1),
        "probe_kernel": said,
        "library_ready_s": None if ready is None else round(ready, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="an exported model folder to probe with")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from edgelite.config import RuntimeConfig
    from edgelite.engine.kernels import build

    if build.build(RuntimeConfig()) is None:  # the probe's own library, built before any timing
        raise SystemExit("cannot build the kernel library here")
    own, every, nodes = [], [], []
    for _ in range(args.rounds):
        own.append(cold_build(every=False))
        every.append(cold_build(every=True))
        with tempfile.TemporaryDirectory(prefix="bench-knode-") as work:
            nodes.append(fresh_node(args.model, Path(work)))
    print(
        json.dumps(
            {
                "cpu": os.uname().machine,
                "cores": os.cpu_count(),
                "load_average": [round(x, 2) for x in os.getloadavg()],
                "cold_build_s": {
                    "this_cpu": [round(x, 1) for x in own],
                    "every_path": [round(x, 1) for x in every],
                    "median_this_cpu": round(statistics.median(own), 1),
                },
                "fresh_node": nodes,
                "targets": {"cold_build_s": 25.0, "probe_answered_s": 20.0},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
