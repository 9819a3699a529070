"""The x86 ISA levels a prebuilt kernel build targets, and which of them this CPU runs.

A build made on one machine (an image's builder stage) runs on others (the pods), so it cannot
use `-march=native`: it is compiled once per level below, and a node loads the highest level
whose every instruction-set extension its CPU lists (`/proc/cpuinfo` flags). The levels follow
the x86-64 micro-architecture levels GCC and Clang name (`x86-64-v3` = AVX2, `x86-64-v4` =
AVX-512), plus AVX512-BF16, the extension the attention kernels' `__AVX512BF16__` paths use
(Cooper Lake, Sapphire Rapids and later Xeons; AMD Zen 4 and later), plus AMX, whose tiles the
prompt attention kernel multiplies on (Sapphire Rapids and later Xeons; `amx.h`). torch's
GEMMs (oneDNN) pick AMX at run time whatever the level.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class IsaLevel:
    name: str
    cflags: tuple[str, ...]      # what the compiler is told to target
    needs: frozenset[str]        # /proc/cpuinfo flags the CPU must list to run that code


# x86-64-v3 includes v2 (SSE3 = "pni", SSSE3, SSE4.1/4.2, POPCNT, CMPXCHG16B, LAHF): every
# AVX2 CPU has them, but a VM may hide some, and the compiler is free to use them all.
_V2 = frozenset({"pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "lahf_lm"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

# Lowest first: `pick` takes the last one the CPU runs.
LEVELS: tuple[IsaLevel, ...] = (
    IsaLevel("avx2", ("-march=x86-64-v3",), _V3),
    IsaLevel("avx512", ("-march=x86-64-v4",), _V4),
    IsaLevel("avx512_bf16", ("-march=x86-64-v4", "-mavx512bf16"), _V4 | {"avx512_bf16"}),
    IsaLevel("amx", ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
             _V4 | {"avx512_bf16", "amx_tile", "amx_bf16"}),
)
BY_NAME = {lv.name: lv for lv in LEVELS}


def is_x86(machine: str | None = None) -> bool:
    """Whether these levels mean anything here (`platform.machine()` by default)."""
    return (machine or platform.machine()).lower() in ("x86_64", "amd64")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The ISA flags of the first CPU listed (all cores of a node are one kind); empty where
    there is no /proc/cpuinfo (not Linux) or it lists no `flags` (not x86)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def pick(flags: frozenset[str], available: list[str]) -> IsaLevel | None:
    """The highest level among `available` (names) that a CPU with `flags` runs; None when
    it runs none of them (an older x86, or another architecture)."""
    runnable = [lv for lv in LEVELS if lv.name in available and lv.needs <= flags]
    return runnable[-1] if runnable else None


def parse_levels(names: tuple[str, ...]) -> tuple[IsaLevel, ...]:
    """`("all",)` or level names -> levels, lowest first; an unknown name is a ValueError
    that lists the known ones."""
    if names == ("all",):
        return LEVELS
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown ISA level {', '.join(unknown)}; known: "
                         f"{', '.join(BY_NAME)} or all")
    return tuple(lv for lv in LEVELS if lv.name in names)
