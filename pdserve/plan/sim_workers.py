"""Run the fast simulator's segment groups in forked worker processes.

Segment groups (`sim_fast.py`) are independent once routing is drawn, so `workers`
processes each take every `workers`-th group. Nothing is pickled: the children are forks
that see the parent's arrays, write their requests' results into arrays in shared
anonymous memory (`shared_empty`), and their counters into one shared row per job.
A child that raises prints its traceback and exits 1; the parent then raises. If the
parent is interrupted while waiting, it kills and reaps the children it started.
"""

from __future__ import annotations

import mmap
import os
import signal
import traceback
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

J = TypeVar("J")  # a job: body's argument


def shared_empty(n: int) -> np.ndarray:
    """float64 array of `n` values in memory that forked children write to for the parent."""
    buf = mmap.mmap(-1, max(8, 8 * n))  # MAP_SHARED | MAP_ANONYMOUS
    return np.frombuffer(buf, np.float64, n)


def fork_map(jobs: Sequence[J], body: Callable[[J], Sequence[float]], workers: int,
             nstats: int) -> np.ndarray:
    """`body(job)` for every job (job k in worker k % workers), returning its `nstats`
    counters as rows of an array; `workers` <= 1 or a single job runs here in order."""
    stats = shared_empty(len(jobs) * nstats).reshape(len(jobs), nstats)
    if workers <= 1 or len(jobs) < 2:
        for k, job in enumerate(jobs):
            stats[k] = body(job)
        return stats
    pids: list[int] = []
    try:
        for w in range(min(workers, len(jobs))):
            pid = os.fork()
            if pid == 0:  # child: never returns into the caller's code
                code = 0
                try:
                    for k in range(w, len(jobs), workers):
                        stats[k] = body(jobs[k])
                except BaseException:
                    traceback.print_exc()
                    code = 1
                finally:
                    os._exit(code)
            pids.append(pid)
        failed = 0
        while pids:
            _, status = os.waitpid(pids[0], 0)
            pids.pop(0)
            failed += status != 0
    finally:
        for pid in pids:  # only left when interrupted: do not leave children behind
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    if failed:
        raise RuntimeError(f"{failed} simulator worker(s) failed (traceback above)")
    return stats
