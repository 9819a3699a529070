"""Executors: where the forward runs.

`InlineExecutor` runs it on the scheduler thread (normal loop). `ThreadedExecutor` runs it
on a dedicated forward thread (overlap loop): torch releases the GIL inside its kernels, so
on CPU the scheduler's Python work really runs beside the forward. On CUDA the forward
uses its own stream; the sampled tokens are copied to pinned host memory on a copy stream
and a CUDA event says when they are there. A `ResultHandle` is what the scheduler keeps
in its result queue; `tokens()` blocks only when the scheduler really needs the values.

No wait is unbounded: a forward thread that dies (an error outside a batch, such as CUDA
refusing its device, or a BaseException) resolves the batch it held and every queued
one with its error, refuses later launches the same way, and a handle whose producer is
gone without resolving it raises instead of waiting. The scheduler then stops with the
error (`run_scheduler`), so a broken device never looks like a node that is merely idle.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from pdserve.engine.batch import Batch
from pdserve.engine.logprobs import LogprobOutput
from pdserve.engine.model_runner import ModelRunner

# How often a blocked `tokens()` checks that its producer still lives.
LIVENESS_POLL_S = 0.5


class ForwardThreadDied(RuntimeError):
    """The forward thread stopped without resolving a batch it was given."""


class ResultHandle:
    def __init__(self, producer_alive: Callable[[], bool] | None = None) -> None:
        self._producer_alive = producer_alive  # None: resolved on the caller's thread
        self._done = threading.Event()
        self._tokens: list[int] | None = None
        self._error: BaseException | None = None
        self._host: torch.Tensor | None = None
        self._event = None  # torch.cuda.Event when the copy is asynchronous
        self._lp: LogprobOutput | None = None  # host copy, when the batch asked

    def resolve(self, host: torch.Tensor | None, event=None,
                error: BaseException | None = None, lp: LogprobOutput | None = None) -> None:
        """Called once by the executor: the batch's sampled tokens (or its error)."""
        self._host, self._event, self._error, self._lp = host, event, error, lp
        self._done.set()

    def ready(self) -> bool:
        return self._done.is_set() and (self._event is None or self._event.query())

    def tokens(self) -> list[int]:
        """Sampled token ids of the batch's sampling rows (blocks until available)."""
        if self._tokens is None:
            while not self._done.wait(LIVENESS_POLL_S):
                if self._producer_alive is not None and not self._producer_alive():
                    if self._done.is_set():  # resolved just before it exited
                        break
                    raise ForwardThreadDied("the forward thread exited without resolving "
                                            "this batch")
            if self._error is not None:
                raise RuntimeError(f"forward failed: {self._error}") from self._error
            if self._event is not None:
                self._event.synchronize()
            self._tokens = self._host.tolist() if self._host is not None else []
        return self._tokens

    def logprobs(self) -> LogprobOutput | None:
        """The batch's logprobs on the host (call after `tokens()`)."""
        return self._lp


class InlineExecutor:
    """Forward on the caller's thread; the result is ready when `launch` returns."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.forward_cpu_s = 0.0  # CPU time of the forward thread's own work (benchmarks)

    def launch(self, batch: Batch) -> ResultHandle:
        handle = ResultHandle()
        t0 = time.thread_time()
        try:
            tokens, lp = self.runner.run(batch)
            handle.resolve(tokens.to("cpu"), lp=lp.to_host() if lp is not None else None)
        except Exception as exc:  # surfaced to the scheduler through tokens()
            handle.resolve(None, error=exc)
        self.forward_cpu_s += time.thread_time() - t0
        return handle

    def close(self) -> None:
        pass


class ThreadedExecutor:
    """Forward on a dedicated thread, fed in launch order by a queue."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.device = runner.device
        self._jobs: queue.Queue = queue.Queue()
        self.forward_cpu_s = 0.0
        self.fatal: BaseException | None = None  # why the forward thread stopped, if it did
        self._lock = threading.Lock()  # orders `fatal` against launches
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            self.copy_stream = torch.cuda.Stream(self.device)
        self._thread = threading.Thread(target=self._main, name="pdserve-forward", daemon=True)
        self._thread.start()

    def launch(self, batch: Batch) -> ResultHandle:
        handle = ResultHandle(self._thread.is_alive)
        with self._lock:
            if self.fatal is not None:
                handle.resolve(None, error=self.fatal)
                return handle
            self._jobs.put((batch, handle))
        return handle

    def _setup_thread(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _main(self) -> None:
        """The thread's body: any error that escapes a batch stops it, failing every batch
        it holds or will be given (never a handle left unresolved)."""
        current: ResultHandle | None = None
        try:
            self._setup_thread()
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                batch, current = job
                t0 = time.thread_time()
                try:
                    self._run_one(batch, current)
                except Exception as exc:  # this batch failed; the thread goes on
                    current.resolve(None, error=exc)
                current = None
                self.forward_cpu_s += time.thread_time() - t0
        except BaseException as exc:
            with self._lock:
                self.fatal = exc
            if current is not None:
                current.resolve(None, error=exc)
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[1].resolve(None, error=exc)

    def _run_one(self, batch: Batch, handle: ResultHandle) -> None:
        if self.device.type != "cuda":
            tokens, lp = self.runner.run(batch)
            handle.resolve(tokens, lp=lp)
            return
        with torch.cuda.stream(self.stream):
            tokens, lp = self.runner.run(batch)
        self.copy_stream.wait_stream(self.stream)
        with torch.cuda.stream(self.copy_stream):
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            lp_host = lp.to_host(non_blocking=True) if lp is not None else None
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        tokens.record_stream(self.copy_stream)
        for t in (lp.tensors().values() if lp is not None else ()):
            t.record_stream(self.copy_stream)
        handle.resolve(host, event, lp=lp_host)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)
