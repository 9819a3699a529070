"""How much slower a node's step gets when other threads want the machine's cores.

A node's forward runs `torch_threads` threads that meet at a barrier after every operator;
when another runnable thread takes one of their cores, the whole step waits for the
preempted thread's next time slice. On a machine whose cores the node's threads fill, one
extra runnable thread costs far more than its share (bench/results/plan_accuracy-*.json:
steps 10-40x slower inside a 2-core PD stack than alone, when every node ran one thread
per core; `pdserve up` now splits the cores, and a 1-thread node's curve measured
[1.0, 1.0, 1.04]), so a linear CPU-share model (`n_threads / cores`) under-predicts badly
wherever threads outnumber cores. This measures the curve instead: the median
time of one fixed decode batch with `k` = 0, 1, 2, ... spinning processes beside it
(`slowdown[k]` = that median / the median at k = 0; non-decreasing, >= 1). Other processes
already on the machine (`runnable_now`, recorded as the profile's `background_load`) sit
under every measured point, so the simulator reads the curve at the number of runnable
threads besides the stepping node *minus* that background (docs/architecture.md: Capacity
planning).
"""

from __future__ import annotations

import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

SPIN = "while True: pass"


def _median_step(rec, rng: random.Random, ids, batch: int, seconds: float) -> float:
    times: list[float] = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds or len(times) < 5:
        pts = rec.run([ids(rng, 128) for _ in range(batch)], 8, rng)
        times += [p[4] for p in pts if p[0] == "decode" and p[3] == batch][1:]
    return statistics.median(times)


def measure_contention(rec, rng: random.Random, ids, levels: int = 2, batch: int = 4,
                       seconds: float = 1.5) -> list[float]:
    """`slowdown[k]` for k = 0..levels spinning processes (see the module doc)."""
    base = _median_step(rec, rng, ids, batch, seconds)
    out = [1.0]
    for k in range(1, levels + 1):
        spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(k)]
        try:
            time.sleep(0.2)  # let them start spinning
            t = _median_step(rec, rng, ids, batch, seconds)
        finally:
            for s in spinners:
                s.kill()
            for s in spinners:
                s.wait()
        out.append(max(out[-1], t / base))
    return out


def runnable_now(seconds: float = 1.0) -> float:
    """Mean runnable threads on the machine over `seconds` (`/proc/loadavg` field 4), less
    the one reading it; 0 where that file does not exist."""
    counts = []
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < seconds:
            counts.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]))
            time.sleep(0.05)
    except OSError:
        return 0.0
    return max(0.0, statistics.mean(counts) - 1)
