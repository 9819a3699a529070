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
