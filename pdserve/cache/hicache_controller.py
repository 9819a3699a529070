"""HiCache copy controller: device->host backups and host->device loads off the scheduler
thread (docs/architecture.md: HiCache).

One copy thread runs operations in submission order (FIFO), so "operation k is done"
means every operation up to k is done, and op ids double as a completion watermark.

- `backup(device_pages, host_pages)` / `load(host_pages, device_pages)` return an op id at
  once. The scheduler thread checks acknowledgements each step (`poll_acks`) and only then
  unlocks the radix nodes involved.
- Loads are copied layer by layer. `wait_layer(layer, op)` lets a forward that reads pages
  of load `op` start as soon as layer 0 is there and wait, before each later layer, only
  for that layer (SGLang's LayerDoneCounter idea): the load of batch N+1 runs while
  forward N runs, and forward N+1 overlaps the tail of its own load.
- CPU: the copy thread copies synchronously; a condition variable publishes per-layer
  progress. CUDA: copies run on a copy stream from/to pinned memory; each loaded layer
  records an event and `wait_layer` makes the forward's stream wait on it.
- `gate` (a threading.Event, normally set) is a test hook: clearing it holds every copy
  that has not started, which is how tests observe loads still pending.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.cache.latency import LatencyHistogram
from pdserve.memory.host_pool import HostKVPool
from pdserve.memory.kv_pool import KVPool


@dataclass
class CopyOp:
    op_id: int
    kind: str  # "backup" (device -> host) or "load" (host -> device)
    device_pages: list[int]
    host_pages: list[int]
    nbytes: int
    after: Callable[[], None] | None = None  # runs on the copy thread once the copy is done
    t_submit: float = field(default_factory=time.perf_counter)
    t_start: float = 0.0
    t_end: float = 0.0


class HiCacheController:
    def __init__(self, device_pool: KVPool, host_pool: HostKVPool, device: torch.device) -> None:
        self.dev, self.host, self.device = device_pool, host_pool, device
        self.num_layers = len(device_pool.k_buffers)
        self.gate = threading.Event()
        self.gate.set()
        self._cv = threading.Condition()
        self._next_id = 0
        self._done_upto = 0  # every op <= this is complete
        self._acked_upto = 0
        self._layer_issued = [0] * self.num_layers  # newest load op whose layer l is issued
        self._layer_events: list = [None] * self.num_layers  # CUDA: that layer's event
        self.last_load = 0
        self.timeline: deque[CopyOp] = deque(maxlen=4096)  # finished ops (tests, metrics)
        self.stats = {"backup_ops": 0, "load_ops": 0, "backup_bytes": 0, "load_bytes": 0,
                      "backup_seconds": 0.0, "load_seconds": 0.0}
        # kind -> latency from submit to done (queueing included)
        self.latency = {k: LatencyHistogram() for k in ("backup", "load")}
        self._error: BaseException | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._cuda = device.type == "cuda"
        if self._cuda:
            self.stream = torch.cuda.Stream(device)
        self._thread = threading.Thread(target=self._loop, name="pdserve-hicache", daemon=True)
        self._thread.start()

    # -- submission (scheduler thread) ------------------------------------------------------
    def _submit(self, kind: str, device_pages: list[int], host_pages: list[int],
                after: Callable[[], None] | None = None) -> int:
        if len(device_pages) != len(host_pages) or not device_pages:
            raise ValueError("a copy needs equal, non-empty device and host page lists")
        self._next_id += 1
        op = CopyOp(self._next_id, kind, list(device_pages), list(host_pages),
                    len(device_pages) * self.host.page_bytes_all_layers, after)
        if kind == "load":
            self.last_load = op.op_id
        self._jobs.put(op)
        return op.op_id

    def backup(self, device_pages: list[int], host_pages: list[int],
               after: Callable[[], None] | None = None) -> int:
        """`after` (the storage tier's write of these host pages) runs on the copy thread
        once they are on the host, before the op counts as done: the pages stay locked."""
        return self._submit("backup", device_pages, host_pages, after)

    def load(self, host_pages: list[int], device_pages: list[int]) -> int:
        return self._submit("load", device_pages, host_pages)

    # -- completion ------------------------------------------------------------------------
    def done(self, op_id: int) -> bool:
        return op_id <= self._done_upto

    @property
    def last_op(self) -> int:
        """The newest submitted op (0: none yet); waiting for it waits for every op."""
        return self._next_id

    def is_loading(self) -> bool:
        """A load was submitted and has not completed."""
        return self.last_load > self._done_upto

    def wait(self, op_id: int, timeout: float | None = None) -> bool:
        with self._cv:
            ok = self._cv.wait_for(lambda: self._done_upto >= op_id or self._error, timeout)
        self._raise_if_failed()
        return bool(ok)

    def wait_layer(self, layer: int, op_id: int) -> None:
        """Block (CPU) or make the current stream wait (CUDA) until layer `layer` of every
        load up to `op_id` is on the device. Called by the forward before reading a layer."""
        if op_id <= 0 or self._done_upto >= op_id:
            return
        with self._cv:
            self._cv.wait_for(lambda: self._layer_issued[layer] >= op_id or self._error)
            event = self._layer_events[layer]
        self._raise_if_failed()
        if self._cuda and event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def poll_acks(self) -> list[int]:
        """Op ids completed since the last call (scheduler thread, once per step)."""
        self._raise_if_failed()
        upto = self._done_upto
        acks = list(range(self._acked_upto + 1, upto + 1))
        self._acked_upto = upto
        return acks

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"HiCache copy failed: {self._error}") from self._error

    # -- copy thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        """Any error, the thread's set-up included, is kept and wakes every waiter: the
        scheduler raises it at its next wait or poll instead of waiting forever."""
        try:
            if self._cuda:
                torch.cuda.set_device(self.device)
            while True:
                op = self._jobs.get()
                if op is None:
                    return
                self._one(op)
        except BaseException as exc:  # surfaced on the scheduler thread
            with self._cv:
                self._error = exc
                self._cv.notify_all()

    def _one(self, op: CopyOp) -> None:
        self.gate.wait()
        op.t_start = time.perf_counter()
        self._run(op)
        if op.after is not None:
            op.after()
        op.t_end = time.perf_counter()
        key = op.kind
        self.stats[f"{key}_ops"] += 1
        self.stats[f"{key}_bytes"] += op.nbytes
        self.stats[f"{key}_seconds"] += op.t_end - op.t_start
        self.latency[op.kind].observe(op.t_end - op.t_submit)
        self.timeline.append(op)
        with self._cv:
            self._done_upto = op.op_id
            self._cv.notify_all()

    def latency_histograms(self) -> dict:
        """{kind: LatencyHistogram.snapshot()} for /metrics."""
        return {kind: h.snapshot() for kind, h in self.latency.items()}

    def _run(self, op: CopyOp) -> None:
        if self._cuda:
            with torch.cuda.stream(self.stream):
                self._copy_layers(op)
            self.stream.synchronize()
        else:
            self._copy_layers(op)

    def _copy_layers(self, op: CopyOp) -> None:
        dev_idx = torch.tensor(op.device_pages, dtype=torch.int64, device=self.device)
        host_idx = torch.tensor(op.host_pages, dtype=torch.int64)
        for layer in range(self.num_layers):
            for dev_buf, host_buf in ((self.dev.k_buffers[layer], self.host.k_buffers[layer]),
                                      (self.dev.v_buffers[layer], self.host.v_buffers[layer])):
                dev_view = dev_buf.view(self.dev.num_pages, self.dev.page_size, *dev_buf.shape[1:])
                host_view = self.host.page_view(host_buf)
                if op.kind == "load":
                    self._to_device(host_view, host_idx, dev_view, dev_idx)
                else:
                    self._to_host(dev_view, dev_idx, host_view, host_idx)
            if op.kind == "load":
                event = None
                if self._cuda:
                    event = torch.cuda.Event()
                    event.record(self.stream)
                with self._cv:
                    self._layer_issued[layer] = op.op_id
                    self._layer_events[layer] = event
                    self._cv.notify_all()

    def _to_device(self, host_view, host_idx, dev_view, dev_idx) -> None:
        if not self._cuda:
            dev_view.index_copy_(0, dev_idx, host_view.index_select(0, host_idx))
            return
        staged = torch.empty((len(host_idx), *host_view.shape[1:]), dtype=host_view.dtype,
                             pin_memory=True)
        torch.index_select(host_view, 0, host_idx, out=staged)
        dev_view.index_copy_(0, dev_idx, staged.to(self.device, non_blocking=True))

    def _to_host(self, dev_view, dev_idx, host_view, host_idx) -> None:
        if not self._cuda:
            host_view.index_copy_(0, host_idx, dev_view.index_select(0, dev_idx))
            return
        staged = torch.empty((len(dev_idx), *dev_view.shape[1:]), dtype=dev_view.dtype,
                             pin_memory=True)
        staged.copy_(dev_view.index_select(0, dev_idx), non_blocking=True)
        self.stream.synchronize()  # the pinned copy must land before the host scatter
        host_view.index_copy_(0, host_idx, staged)

    def close(self) -> None:
        self.gate.set()
        self._jobs.put(None)
        self._thread.join(timeout=30)
