"""The two scheduling loops, side by side (docs/architecture.md: Overlap scheduling). Each `step()`
is one iteration.

normal:  schedule -> run -> process result. The device idles while the CPU processes the
         result and builds the next batch.
overlap: schedule N+1 and launch it, then process the result of N while N+1 runs.
         `results` holds (batch snapshot, handle) pairs; its depth is at most 2 right after
         a launch and 1 between steps. Overlap is skipped for one batch when the scheduler
         needs every in-flight result first (retraction), or, when `sync_consecutive_prefill`
         is set, for a prefill batch right after a prefill batch (the first prefill's tokens
         then reach the client before the second prefill runs); each skip is counted by
         reason. A prefill node never sets it: every batch there is a prefill, and its result
         processing (first tokens, KV sends) is the work that must hide behind the next
         forward (docs/architecture.md, overlap scheduling).
"""

from __future__ import annotations

import time
from collections import Counter, deque

from pdserve.engine.batch import Batch
from pdserve.engine.executor import InlineExecutor, ResultHandle, ThreadedExecutor
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.scheduler import NEED_SYNC, Scheduler


class LoopStats:
    def __init__(self) -> None:
        self.steps = 0
        self.batches = 0
        self.sched_cpu_s = 0.0  # scheduler-thread CPU time spent building and processing
        self.overlap_disabled: Counter[str] = Counter()


class NormalLoop:
    def __init__(self, sched: Scheduler, executor: InlineExecutor, out: OutputProcessor) -> None:
        self.sched, self.executor, self.out = sched, executor, out
        self.stats = LoopStats()

    def step(self) -> None:
        self.stats.steps += 1
        t0 = time.thread_time()
        batch = self.sched.next_batch(in_flight=False)
        t1 = time.thread_time()
        if batch is None:
            self.out.mark_idle()
            return
        assert isinstance(batch, Batch)  # NEED_SYNC only comes with in_flight=True
        handle = self.executor.launch(batch)  # runs the forward right here
        t2 = time.thread_time()
        self.out.process(batch, handle)
        self.stats.batches += 1
        self.stats.sched_cpu_s += (t1 - t0) + (time.thread_time() - t2)

    def drain(self) -> None:
        self.out.mark_idle()

    def in_flight(self) -> int:
        """Launched batches whose results are not processed yet (never any here)."""
        return 0

    def discard(self) -> None:
        """Drop unprocessed results (after a failed step); nothing to drop here."""


class OverlapLoop:
    def __init__(self, sched: Scheduler, executor: ThreadedExecutor, out: OutputProcessor,
                 sync_consecutive_prefill: bool = False) -> None:
        self.sched, self.executor, self.out = sched, executor, out
        self.sync_consecutive_prefill = sync_consecutive_prefill
        self.results: deque[tuple[Batch, ResultHandle]] = deque()
        self.stats = LoopStats()
        self.max_depth = 0

    def step(self) -> None:
        self.stats.steps += 1
        t0 = time.thread_time()
        batch = self.sched.next_batch(in_flight=bool(self.results))
        if batch is NEED_SYNC:
            self.stats.overlap_disabled["retract"] += 1
            self._process_all()
            batch = self.sched.next_batch(in_flight=False)
        assert batch is None or isinstance(batch, Batch)
        if (self.sync_consecutive_prefill and batch is not None and batch.kind == "extend"
                and self._last_kind() == "extend"):
            self.stats.overlap_disabled["consecutive_prefill"] += 1
            self._process_all()
        if batch is not None:
            self.results.append((batch, self.executor.launch(batch)))
            self.stats.batches += 1
            self.max_depth = max(self.max_depth, len(self.results))
        # Process the previous batch's result while the one just launched runs.
        if len(self.results) > 1 or (batch is None and self.results):
            self._process_one()
        elif batch is None:
            self.out.mark_idle()
        self.stats.sched_cpu_s += time.thread_time() - t0

    def _last_kind(self) -> str | None:
        return self.results[-1][0].kind if self.results else None

    def _process_one(self) -> None:
        batch, handle = self.results.popleft()
        self.out.process(batch, handle)

    def _process_all(self) -> None:
        while self.results:
            self._process_one()

    def drain(self) -> None:
        self._process_all()
        self.out.mark_idle()

    def in_flight(self) -> int:
        return len(self.results)

    def discard(self) -> None:
        self.results.clear()
