"""This CPU's features and the compile units (with their flags) a library for it is built from.

Flags are spelled out from the features, never `-march=native` / `-mcpu=native`: on ARM, clang
infers SVE from a Snapdragon 8 Gen 1-3's CPU name while the phone's kernel does not enable it,
and the first SVE instruction kills the process (llama.cpp issues 402, 10890, 10906). Every
unit is built with -ffp-contract=off, so every path gives the reference's bits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).with_name("src")
# every unit: no fused multiply-adds but those written so (the same bits from every compiler,
# ISA and optimisation level), position-independent for dlopen, vector arguments without the
# ABI note; the glue and the reference at -O2, a path at -O3 (measured with GCC 12 on AVX-512:
# at -O2 its small fixed loops stay loops, its registers arrays in memory: products 1.4-2.1x,
# attention 1.7-6x slower; with -fpeel-loops still 5-28 % on the float attention)
COMMON = ("-ffp-contract=off", "-fPIC", "-pthread", "-fvisibility=hidden", "-Wno-psabi")
BASE_OPT, PATH_OPT = "-O2", "-O3"
AT_HWCAP, AT_HWCAP2 = 16, 26
HWCAP_ASIMD, HWCAP_ASIMDDP, HWCAP_SVE = 1 << 1, 1 << 20, 1 << 22
HWCAP2_I8MM = 1 << 13
X86 = ("x86_64", "amd64", "i686", "i386")
ARM = ("aarch64", "arm64")


@dataclass(frozen=True)
class Unit:
    """One compile unit: a source of src/ and the flags it is built with; `path` names the kernel
    path it holds (ops and ref: always built), `needs` the features it may run on."""

    source: str
    flags: tuple[str, ...]
    path: str
    needs: frozenset[str] = frozenset()


# the units of each ISA family, best path last; a path's unit needs its features
X86_UNITS = (
    Unit("x86_avx2.c", (PATH_OPT, "-mavx2", "-mfma", "-mf16c"), "avx2", frozenset({"avx2", "fma", "f16c"})),
    Unit(
        "x86_avx512.c",
        (
            PATH_OPT,
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mavx512vnni",
            "-mavx512vbmi",
            "-mavx2",
            "-mfma",
            "-mf16c",
        ),
        "avx512",
        frozenset(
            {
                "avx2",
                "fma",
                "f16c",
                "avx512f",
                "avx512bw",
                "avx512vl",
                "avx512dq",
                "avx512_vnni",
                "avx512vbmi",
            }
        ),
    ),
)
ARM_UNITS = (
    Unit("arm_neon.c", (PATH_OPT, "-march=armv8-a"), "neon", frozenset({"asimd"})),
    Unit("arm_dotprod.c", (PATH_OPT, "-march=armv8.2-a+dotprod"), "dotprod", frozenset({"asimd", "asimddp"})),
    Unit(
        "arm_i8mm.c",
        (PATH_OPT, "-march=armv8.2-a+dotprod+i8mm"),
        "i8mm",
        frozenset({"asimd", "asimddp", "i8mm"}),
    ),
)


def machine(name: str | None = None) -> str:
    """x86, arm or other (the ISA family), of `name` or this machine."""
    m = (name or platform.machine()).lower()
    return "x86" if m in X86 else "arm" if m in ARM else "other"


def base_units(family: str) -> tuple[Unit, ...]:
    """What every library is built from: the operators' glue and the reference path, with the
    family's baseline flags (ARMv8.0 spelled out: its baseline has NEON, and never SVE)."""
    flags = (BASE_OPT, "-march=armv8-a") if family == "arm" else (BASE_OPT,)
    return Unit("ops.c", flags, "ops"), Unit("ref.c", flags, "ref")


def features(family: str | None = None, cpuinfo: str | None = None) -> frozenset[str]:
    """This CPU's features by the names /proc/cpuinfo uses (x86: its flags; ARM: getauxval's
    HWCAP bits, else /proc/cpuinfo's Features). `cpuinfo`: that file's text, for tests."""
    family = family or machine()
    text = cpuinfo
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            text = ""
    listed: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            listed |= set(value.split())
    if family == "arm" and cpuinfo is None:
        hw = _auxval()
        if hw is not None:
            cap, cap2 = hw
            listed = {
                name
                for name, bit, word in (
                    ("asimd", HWCAP_ASIMD, cap),
                    ("asimddp", HWCAP_ASIMDDP, cap),
                    ("sve", HWCAP_SVE, cap),
                    ("i8mm", HWCAP2_I8MM, cap2),
                )
                if word & bit
            }
    return frozenset(listed)


def _auxval() -> tuple[int, int] | None:
    """getauxval(AT_HWCAP) and (AT_HWCAP2), or None where libc has no getauxval."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        get = libc.getauxval
    except (OSError, AttributeError):
        return None
    get.restype, get.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
    return int(get(AT_HWCAP)), int(get(AT_HWCAP2))


def units(family: str, have: frozenset[str], every: bool = False) -> list[Unit]:
    """The units to build: the base ones and the best path whose features `have` holds (with
    `every`, each such path: the tests compare them); ARM's i8mm unit holds the dotprod code too."""
    usable = [
        u for u in (X86_UNITS if family == "x86" else ARM_UNITS if family == "arm" else ()) if u.needs <= have
    ]
    return [*base_units(family), *(usable if every else usable[-1:])]


def level(family: str, have: frozenset[str]) -> str:
    """The best path these features run (ref where none)."""
    chosen = units(family, have)
    return chosen[-1].path if len(chosen) > 2 else "ref"
