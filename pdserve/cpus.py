"""How many CPU cores this process may run on (light: no torch import)."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """Cores in this process's affinity mask (a container's or taskset's limit counts)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def split_cores(nodes: int, cores: int | None = None) -> int:
    """Forward threads for each of `nodes` processes sharing this machine: its cores split
    evenly, at least one each. Two nodes each running one thread per core keep every core
    oversubscribed: their OpenMP threads spin-wait at each operator's barrier while the
    other node's threads hold the cores (docs/architecture.md: CPU threads)."""
    return max(1, (cores or usable_cores()) // max(1, nodes))


# Instruction-set extensions the CPU kernels choose between, strongest first.
_ISA_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def cpu_description() -> str:
    """The CPU model and the kernel-relevant extensions it has, e.g. "AMD EPYC (avx2), 2
    cores": every benchmark figure names the machine kind it was taken on."""
    model, flags = "unknown CPU", set[str]()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    isa = [f for f in _ISA_FLAGS if f in flags]
    return f"{model} ({', '.join(isa) or 'no AVX2'}), {usable_cores()} cores"
