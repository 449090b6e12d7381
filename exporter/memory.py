"""The exporter's memory: what this process holds, what an export of a model will need, and
how many of the export's layers its greedy check may load at once (`--max-memory-mb`).

An export holds one layer at a time: its tensors as read and converted, then, to verify it,
transformers' float32 copy of the layer beside the export's own graph of it. So the need grows
with the width of the largest layer, not with the number of layers. The estimate is checked
before anything is written: an export that cannot fit is refused at the start with the figures.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from edgelite.engine.profile import meminfo, peak_resident_bytes, resident_bytes
from edgelite.errors import EdgeliteError

MIB = 1 << 20
BUDGET_SHARE = 0.5  # default budget: this share of the machine's RAM ...
AVAILABLE_SHARE = 0.9  # ... and of what is available now, whichever is less
# the estimate, per byte of the largest layer's weights as float32 (F) and as exported (E):
# verification holds the reference layer (F), a dequantized tensor being compared (up to F/2)
# and the export's layer loaded by onnxruntime (E, plus its prepacked copy)
VERIFY_FLOAT = 1.6
RUNTIME_COPIES = 2.5  # an export's layer as loaded: mapped weights + prepacked copies
CONVERT_FLOAT = 1.2  # converting a layer: its tensors as float32 (quantizing) or raw + codes
TABLE_COPIES = 1.5  # the embedding (rows read as used) and head (prepacked) as loaded
ACTIVATION_MARGIN = 128 * MIB  # hidden states, attention scores, the head's logits blocks


def rss_bytes() -> int:
    """The process's resident set now (0 where /proc cannot tell)."""
    return resident_bytes() or 0


def peak_rss_bytes() -> int:
    """The process's peak resident set so far (VmHWM; getrusage where /proc is missing)."""
    peak = peak_resident_bytes()
    if peak is not None:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def default_budget_mb() -> int:
    """A sensible share of this machine's memory."""
    mem = meminfo()
    total = mem.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = mem.get("MemAvailable") or total
    return int(min(BUDGET_SHARE * total, AVAILABLE_SHARE * available) // MIB)


@dataclass(frozen=True)
class Need:
    """What one export needs, from its tensors' sizes."""

    layer_float: int  # the largest layer's weights as float32, bytes
    layer_export: int  # the largest layer as exported, bytes
    table_export: int  # the embedding and head as exported, bytes
    layers: int
    export_total: int  # every layer as exported, bytes

    def peak(self, baseline: int) -> int:
        """The estimated peak of the process: baseline + the largest layer's working set."""
        convert = CONVERT_FLOAT * self.layer_float + self.layer_export
        check = VERIFY_FLOAT * self.layer_float + RUNTIME_COPIES * self.layer_export
        return int(baseline + max(convert, check) + TABLE_COPIES * self.table_export
                   + ACTIVATION_MARGIN)


def check(need: Need, budget_mb: int, baseline: int) -> None:
    """An error at the start when the export cannot fit."""
    budget = budget_mb * MIB
    peak = need.peak(baseline)
    if peak > budget:
        raise EdgeliteError(
            f"this export needs about {peak // MIB} MiB (its largest layer holds "
            f"{need.layer_float // MIB} MiB of float32 weights; this process already uses "
            f"{baseline // MIB} MiB), over --max-memory-mb {budget_mb}; give it more")
