"""This device: memory, battery, CPUs, and how fast it runs a model's layer (FLOP/s).

Nodes report it when profiled; the client measures itself the same way, so the planner compares
like with like.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgelite.engine.layers import LayerRange


def meminfo(path: Path = Path("/proc/meminfo")) -> dict[str, int]:
    out = {}
    try:
        for line in path.read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out


def resident_bytes() -> int | None:
    """This process's resident set now (None where /proc cannot tell)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_resident_bytes() -> int | None:
    """This process's peak resident set (VmHWM: since it started, or since the peak was last
    reset through /proc/self/clear_refs); None where /proc cannot tell."""
    try:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def battery() -> dict[str, Any]:
    """Battery level/charging/temperature where the kernel exposes them (Android does); else {}."""
    base = Path("/sys/class/power_supply/battery")
    out: dict[str, Any] = {}
    for key, name, conv in (("capacity", "battery_percent", int), ("status", "charging", str),
                            ("temp", "battery_temp_c", lambda v: int(v) / 10)):
        try:
            raw = (base / key).read_text().strip()
        except OSError:
            continue
        out[name] = raw == "Charging" if key == "status" else conv(raw)
    return out


def host_profile() -> dict[str, Any]:
    mem = meminfo()
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(),
            "machine": platform.machine(), "memory_total_bytes": mem.get("MemTotal"),
            "memory_available_bytes": mem.get("MemAvailable"), "rss_bytes": resident_bytes(),
            **battery()}


EVICT_BYTES = 64 * 1024 * 1024  # larger than a phone's (or this PC's) last-level cache


def median_seconds(fn: Callable[[], object], repeats: int, before: Callable[[], object] | None = None,
                   inner: int = 1) -> float:
    """Median wall time of fn() over `repeats` samples (each `inner` calls) after one warm-up;
    `before` runs untimed ahead of each sample."""
    fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def range_decode_seconds(layers: LayerRange, past: int = 64, repeats: int = 20) -> float:
    """Median time of one decode step through a layer range (blocking), after a prompt of
    `past` tokens. In real decoding a layer's weights were evicted by everything run since its
    last step, so every timed step starts with a cold cache."""
    import numpy as np

    rng = np.random.default_rng(0)
    h = layers.manifest.hidden_size
    slot = layers.pool.acquire()
    try:
        prompt = rng.standard_normal((1, min(past, layers.max_chunk), h)).astype(np.float32)
        layers.run(slot, prompt)
        token = rng.standard_normal((1, 1, h)).astype(np.float32)
        start = slot.length
        evict = np.zeros(EVICT_BYTES // 4, np.float32)

        def step() -> None:
            slot.length = start  # every timed step writes the same position
            layers.run(slot, token)

        return median_seconds(step, repeats, before=lambda: np.add(evict, 1.0, out=evict))
    finally:
        layers.pool.release(slot)


def gemv_seconds(hidden_size: int, weight_bytes: int, repeats: int = 20) -> float:
    """Median time of a (1, h) x (h, weight_bytes / 4h) float32 product with a cold cache: a
    decode step's memory traffic when no layer file is at hand."""
    import numpy as np

    cols = max(1, weight_bytes // (4 * hidden_size))
    a = np.ones((1, hidden_size), np.float32)
    w = np.ones((hidden_size, cols), np.float32)
    evict = np.zeros(EVICT_BYTES // 4, np.float32)
    return median_seconds(lambda: a @ w, repeats, before=lambda: np.add(evict, 1.0, out=evict))


def gemv_flops(hidden_size: int, repeats: int = 20) -> float:
    """FLOP/s of a (1, h) x (h, 4h) numpy product: the fallback when no layer is deployed."""
    import numpy as np

    a = np.ones((1, hidden_size), np.float32)
    w = np.ones((hidden_size, 4 * hidden_size), np.float32)
    return 2 * hidden_size * 4 * hidden_size / median_seconds(lambda: a @ w, repeats, inner=2)
