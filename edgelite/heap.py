"""The C heap of a long-running process: large freed buffers go back to the system.

glibc's malloc raises its mmap threshold as large blocks are freed, after which such blocks
come from the heap and, once freed, stay with the process: a loop that makes and drops buffers
of tens of MB (a layer's activations, a session's scratch) then grows by that much again and
again (measured: +25 MB a layer while the exporter verified SmolLM2, 0.5 -> 1.4 GB). A fixed
threshold maps every block above it, and a mapped block is unmapped when freed.
"""

from __future__ import annotations

import ctypes
import logging
import platform
from collections.abc import Callable

log = logging.getLogger(__name__)
M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20  # blocks this large or larger are mapped (and unmapped when freed)
TRIM_THRESHOLD_BYTES = 8 << 20  # free heap top beyond this goes back to the system


def _glibc(call: Callable[[ctypes.CDLL], bool], what: str) -> bool:
    """call(glibc) where the C library is glibc (elsewhere, e.g. Android's bionic: False)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        return call(ctypes.CDLL(None))
    except (OSError, AttributeError) as exc:
        log.debug("%s: %s", what, exc)
        return False


def give_back_large_blocks() -> bool:
    """Fix glibc's mmap threshold (elsewhere, e.g. Android's bionic: nothing). True if set."""
    return _glibc(lambda libc: (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1)
                  & (libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1), "mallopt")


def trim() -> bool:
    """Give the heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing):
    after a layer range is closed its many small blocks stay with the process otherwise (a node
    that unloaded SmolLM2's layers kept holding ~50 MiB, and its next load was refused)."""
    return _glibc(lambda libc: bool(libc.malloc_trim(0)), "malloc_trim")
