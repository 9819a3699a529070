"""Which scheduling loop a node runs: overlap where it is faster, normal where it is not.

The overlap loop hides the scheduler's CPU work (result processing, building the next
batch) behind the forward. That pays when the forward runs somewhere else: on a GPU, or
on CPU cores the scheduler thread does not need. On a CPU whose every core already runs
one of torch's intra-op threads, the scheduler thread can only take time from the forward
(and they hand the GIL back and forth between ops), so the normal loop measures faster
(`bench/overlap.py`: normal/overlap TPOT 0.91 at tiny bs1 and smollm2 bs8 on 2 cores).
`loop="auto"` encodes that rule; `overlap` / `normal` force one. The choice and its reason
are reported in `/server_info` and by `pdserve generate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.cpus import usable_cores

LOOPS = ("auto", "overlap", "normal")


@dataclass(frozen=True)
class LoopChoice:
    loop: str  # "overlap" | "normal"
    reason: str

    @property
    def overlap(self) -> bool:
        return self.loop == "overlap"


def choose_loop(requested: str, device: torch.device) -> LoopChoice:
    if requested not in LOOPS:
        raise ValueError(f"loop must be one of {', '.join(LOOPS)}, got {requested!r}")
    if requested != "auto":
        return LoopChoice(requested, f"--loop {requested}")
    if device.type != "cpu":
        return LoopChoice("overlap", f"auto: the forward runs on {device.type}, "
                                     "the scheduler thread overlaps it")
    cores, threads = usable_cores(), torch.get_num_threads()
    if cores > threads:
        return LoopChoice("overlap", f"auto: {cores} cores > {threads} forward threads, "
                                     "a core is free for the scheduler thread")
    return LoopChoice("normal", f"auto: the forward's {threads} threads use all {cores} "
                                "cores; an overlapped scheduler thread would slow it")
