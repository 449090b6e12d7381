"""What each piece of an export holds once loaded and run in edgelite's engine, measured, so
that the planner and the nodes count what a layer really costs, not its file's bytes:
onnxruntime packs block weights again at load (scales and block sums beside the codes).

Each kind of layer (same weight and file bytes, same window) is measured once, in a process of
its own: the layer is loaded LOADS times and the resident set's growth after the first load,
averaged, is its cost (the first also pays for onnxruntime's one-time state, which is the
process's baseline, not the layer's); then a prompt chunk of SCRATCH_CHUNK tokens runs through
it and the peak above that is its scratch. A range holds some things once, whatever its length
(its RoPE tables, a session's own state, and in a node, the first range, onnxruntime's one-time
state): where the layer has a neighbour of its kind, the two are measured as one range the same
way (in a process of their own), and the layer's cost is what the second adds; what the first
load in the process took beyond that is the range's (Manifest.range_bytes: counted once a
device; SmolLM2 3.2 MiB a layer, 17-20 a range); a kind without such a neighbour keeps the
whole first figure. The embedding and the head are measured the same way, with the peak of their
load (widening a large table's scales takes a transient: the 1 B head holds 175 MiB, 289 while
it loads).

    python -m edgelite_export.resident EXPORT_DIR PIECE [narrow]
        (PIECE: a layer index J, J:J+1 (with its neighbour), embed, head; narrow: with
        edgelite's product operators (engine/kernels))

Where this machine runs edgelite's product operators (engine/kernels) (AVX-512 VNNI and VBMI),
each piece is measured both ways: with onnxruntime's MatMulNBits (what any device holds) and
with them (the manifest's narrow_* figures, what a device that has them holds).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from edgelite import heap
from edgelite import manifest as mf
from edgelite.config import RuntimeConfig
from edgelite.errors import EdgeliteError
from edgelite_export.memory import peak_rss_bytes, rss_bytes

log = logging.getLogger(__name__)
LOADS = 3  # the piece is loaded this often; the growth after the first, averaged, is its cost
MEASURE_TIMEOUT_S = 600.0  # one piece's measurement (an 8 B layer loads in seconds)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # (Linux 4.0+: the peak starts again from now)
    except OSError:
        return False
    return True


def measure_piece(m: mf.Manifest, piece: str, narrow: bool = False) -> tuple[int, int, int]:
    """(resident, scratch, first) bytes of a layer J or a range J:K (first: what its first load
    in this process took, onnxruntime's one-time state with it), or (resident, load peak, 0) of
    the embedding or the head, in this process (see the module's note); `narrow`: with its
    products in edgelite's product operators (where this machine has them)."""
    from edgelite.engine.layers import LayerRange, export_files
    from edgelite.engine.runtime import Embedding, Head

    heap.give_back_large_blocks()
    cfg = RuntimeConfig(threads=1, verify_hashes=False, matmul_kernel=narrow)
    files = export_files(m, verify=False)
    held: list[object] = []
    if piece in ("embed", "head"):
        hidden = np.zeros((1, 1, m.hidden_size), np.float32)
        peak = 0
        for i in range(LOADS):
            if i == 1:
                before = rss_bytes()
                measured = _reset_peak()
            p = Embedding(m, cfg, files) if piece == "embed" else Head(m, cfg, files)
            if isinstance(p, Embedding):
                p.run(np.zeros((1, 1), np.int64))
            else:
                p.run(hidden)
            held.append(p)
            if i == 1 and measured:  # loading widens its scales in memory: a transient on top
                peak = peak_rss_bytes() - before
        return max(0, rss_bytes() - before) // (LOADS - 1), peak, 0
    lo, _, hi = piece.partition(":")
    j, k = int(lo), int(hi or lo)
    start = rss_bytes()
    for i in range(LOADS):
        if i == 1:
            before = rss_bytes()
            first = before - start  # the first load: onnxruntime's one-time state too
        lr = LayerRange(m, j, k, cfg, files)
        slot = lr.pool.acquire()
        lr.run(slot, np.zeros((1, 1, m.hidden_size), np.float32))
        held.append(lr)
    resident = max(0, rss_bytes() - before) // (LOADS - 1)
    scratch, now = 0, rss_bytes()
    if _reset_peak():
        n = min(mf.SCRATCH_CHUNK, lr.pool.max_length - slot.length)  # (a tiny model's context)
        lr.run(slot, np.full((1, n, m.hidden_size), 0.01, np.float32))
        scratch = max(0, peak_rss_bytes() - now)
    return resident, scratch, max(0, first)


def _kind(e: mf.FileEntry) -> tuple[int, ...]:
    return (e.param_bytes, sum(d.bytes for d in e.data), e.window)


def measured(m: mf.Manifest) -> mf.Manifest:
    """The manifest with resident_bytes (and layers' scratch_bytes) measured; unchanged where
    this platform cannot tell (no /proc)."""
    if rss_bytes() == 0:
        return m
    from edgelite.engine.passes import linear

    # (each figure twice where this machine runs edgelite's product operators: with onnxruntime's
    # MatMulNBits, what any device holds, and with them, what a device that has them holds)
    narrow = linear.narrow(RuntimeConfig(threads=1), m)
    def run(piece: str) -> tuple[int, ...]:
        """(resident, scratch or load peak, first) with MatMulNBits, then the same narrow (0,
        0, 0 when this machine has no narrow products)."""
        return (*_measure(piece, False), *(_measure(piece, True) if narrow else (0, 0, 0)))

    def _measure(piece: str, with_kernel: bool) -> tuple[int, int, int]:
        res = subprocess.run([sys.executable, "-m", "edgelite_export.resident", str(m.root), piece,
                              *(["narrow"] if with_kernel else [])],
                             capture_output=True, text=True, timeout=MEASURE_TIMEOUT_S)
        if res.returncode != 0:
            raise EdgeliteError(f"measuring {piece} of the export failed: "
                                f"{(res.stderr.strip().splitlines() or ['?'])[-1]}")
        out = json.loads(res.stdout)
        return int(out["resident"]), int(out["scratch"]), int(out["first"])

    kinds = [_kind(e) for e in m.layers]

    def paired(j: int) -> bool:
        """Layer j's next is of its kind."""
        return j + 1 < len(kinds) and kinds[j + 1] == kinds[j]

    # each kind at its first layer whose next is of its kind (that pair measured too), else its first
    first: dict[tuple[int, ...], int] = {}
    for j, k in enumerate(kinds):
        if k not in first or (paired(j) and not paired(first[k])):
            first[k] = j
    cache: dict[tuple[int, ...], tuple[int, int, int, int]] = {}
    # a range's own part (MatMulNBits, narrow), the most any pair showed: what the first load of
    # a range in a process takes beyond its layers (a node holds one range a model; the first
    # range of a process pays onnxruntime's one-time state too, which it counts with it)
    ranges = [0, 0]
    for k, j in first.items():
        one = run(str(j))
        resident, scratch, once, narrow_resident, narrow_scratch, narrow_once = one
        if paired(j):
            two = run(f"{j}:{j + 1}")
            resident = min(resident, max(0, two[0] - one[0]))  # what the second layer adds
            narrow_resident = min(narrow_resident, max(0, two[3] - one[3]))
            ranges = [max(ranges[0], once - resident), max(ranges[1], narrow_once - narrow_resident)]
        cache[k] = (resident, scratch, narrow_resident, narrow_scratch)
    layers = []
    for e, k in zip(m.layers, kinds, strict=True):
        resident, scratch, narrow_resident, narrow_scratch = cache[k]
        layers.append(replace(e, resident_bytes=resident, scratch_bytes=scratch,
                              narrow_resident_bytes=narrow_resident, narrow_scratch_bytes=narrow_scratch))
    embed, head = ((replace(e, resident_bytes=held, load_peak_bytes=peak, narrow_resident_bytes=nheld,
                            narrow_load_peak_bytes=npeak)
                    for e, (held, peak, _, nheld, npeak, _) in ((m.embed, run("embed")),
                                                                 (m.head, run("head")))))
    log.info("resident once loaded: layers %.1f-%.1f MiB (%d kinds; weights %.1f MiB at most; "
             "a %d-token chunk %.1f MiB more), embedding %.1f, head %.1f MiB (%.1f loading)",
             min(e.resident_bytes for e in layers) / 2**20, max(e.resident_bytes for e in layers) / 2**20,
             len(cache), max(e.param_bytes for e in layers) / 2**20, mf.SCRATCH_CHUNK,
             max(e.scratch_bytes for e in layers) / 2**20, embed.resident_bytes / 2**20,
             head.resident_bytes / 2**20, head.load_peak_bytes / 2**20)
    if narrow:
        log.info("with edgelite's product operators: layers %.1f-%.1f MiB, head %.1f MiB (%.1f loading)",
                 min(e.narrow_resident_bytes for e in layers) / 2**20,
                 max(e.narrow_resident_bytes for e in layers) / 2**20, head.narrow_resident_bytes / 2**20,
                 head.narrow_load_peak_bytes / 2**20)
    log.info("a range's own part (held once however many layers): %.1f MiB", ranges[0] / 2**20)
    return replace(m, layers=layers, embed=embed, head=head, range_bytes=ranges[0],
                   narrow_range_bytes=ranges[1])


def main(argv: list[str]) -> int:
    m = mf.load(Path(argv[0]))
    resident, scratch, first = measure_piece(m, argv[1], argv[2:] == ["narrow"])
    sys.stdout.write(json.dumps({"resident": resident, "scratch": scratch, "first": first}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
