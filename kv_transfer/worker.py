"""The single transfer thread of a prefill manager.

All engine calls happen here, never on the scheduler's thread (a call can block for the
whole transfer timeout on a frozen peer) and never on two threads at once (concurrent
large batches poison Mooncake's path to a peer; more threads are also slower on small
machines). Jobs run in FIFO order, so the chunks of one room are written in order.

Recovery: when a write fails but the peer still answers a probe, the engine->peer path is
presumed poisoned; the engine is re-created, memory re-registered and the batch retried
once. A dead peer does not answer the probe, so its rooms simply fail.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from kv_transfer.backends.base import TransferBackend
from kv_transfer.config import KVTransferConfig
from kv_transfer.lease import LeaseCell
from kv_transfer.memory import HostMemory
from kv_transfer.metrics import TransferStats
from kv_transfer.poll import KVPoll, RoomStatus
from kv_transfer.runs import Entries

log = logging.getLogger(__name__)
T = TypeVar("T")
_LEASE_POLL_S = 0.005
_LEASE_LOST = "lease lost"  # _write's answer when the retry may not be written


@dataclass
class TransferJob:
    """One send() of one room: entries for all layers (and metadata rows when last)."""

    room: int
    status: RoomStatus
    session: str
    entries: Entries
    start: int  # destination-page positions [start, end) covered by this job
    end: int
    last: bool
    crc_regions: list[tuple[int, int]] | None  # canonical source regions, checksums only
    lease: LeaseCell | None = None  # the room's write lease (None: not fenced)


@dataclass
class JobResult:
    job: TransferJob
    ok: bool
    skipped: bool  # the room had failed before (or while) it was written
    reason: str | None
    checksum: int
    refused: bool = False  # not written: the room's lease had run out (lease.py)


class TransferWorker:
    def __init__(self, backend: TransferBackend, config: KVTransferConfig,
                 stats: TransferStats, on_result: Callable[[JobResult], None],
                 memory: HostMemory | None = None) -> None:
        self._backend = backend
        self._memory = memory or HostMemory()  # the CRC reads staged bytes for device KV
        self._config = config
        self._stats = stats
        self._on_result = on_result
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kv-transfer", daemon=True)
        self._thread.start()

    def submit(self, job: TransferJob) -> None:
        self._queue.put(job)

    def call(self, fn: Callable[[TransferBackend], T]) -> Future[T]:
        """Run fn(backend) on the transfer thread (engine access is single-threaded)."""
        fut: Future[T] = Future()
        self._queue.put((fn, fut))
        return fut

    def stop(self, timeout: float = 10.0) -> bool:
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if isinstance(item, TransferJob):
                    self._on_result(self._safe_process(item))
                else:
                    fn, fut = item
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn(self._backend))
                        except BaseException as exc:
                            fut.set_exception(exc)
            except Exception:  # never let one bad job kill the node's only transfer thread
                log.exception("kv transfer thread: unexpected error")

    def _safe_process(self, job: TransferJob) -> JobResult:
        # Every job must report back, or its room would wait for it forever.
        try:
            return self._process(job)
        except Exception as exc:
            log.exception("kv transfer thread: job of room %d failed", job.room)
            return JobResult(job, ok=False, skipped=False, checksum=0,
                             reason=f"transfer failed: {type(exc).__name__}: {exc}")

    def _process(self, job: TransferJob) -> JobResult:
        for batch in job.entries.batches(self._config.max_batch_entries):
            if job.status.state == KVPoll.Failed:
                return JobResult(job, ok=False, skipped=True, reason=None, checksum=0)
            # The lease is checked right before every write, retries included, on our
            # clock: after a pause (SIGSTOP, partition) the decode may have reused these
            # pages. Never write late.
            if job.lease is not None and not self._await_lease(job):
                return self._refusal(job)
            reason = self._write(job, batch)
            if reason is _LEASE_LOST:
                return self._refusal(job)
            if reason is not None:
                return JobResult(job, ok=False, skipped=False, reason=reason, checksum=0)
        crc = self._memory.crc(job.crc_regions) if job.crc_regions is not None else 0
        return JobResult(job, ok=True, skipped=False, reason=None, checksum=crc)

    @staticmethod
    def _refusal(job: TransferJob) -> JobResult:
        """A write not made: its room failed or its lease ran out."""
        failed = job.status.state == KVPoll.Failed
        return JobResult(job, ok=False, skipped=failed, checksum=0, refused=True,
                         reason=None if failed else "write lease expired")

    def _await_lease(self, job: TransferJob) -> bool:
        """Is the room's lease live? A lapsed one gets one lease period to be renewed (the
        control thread asks the decode every quarter of it): a slow answer only delays
        the write, while a room the decode gave up fails meanwhile (or stays expired)."""
        assert job.lease is not None
        deadline = time.monotonic() + self._config.write_lease_s
        while not job.lease.valid():
            if job.status.state == KVPoll.Failed or time.monotonic() > deadline:
                return False
            time.sleep(_LEASE_POLL_S)
        return True

    def _write(self, job: TransferJob, batch: Entries) -> str | None:
        session, room = job.session, job.room
        rc = self._counted_write(session, batch, room)
        if rc == 0:
            return None
        if not self._backend.probe(session):
            return f"transfer failed: peer {session} unreachable (rc={rc})"
        log.warning("kv transfer: write to live peer %s failed (rc=%d); re-creating engine",
                    session, rc)
        self.recreate()  # can take long enough for the lease to run out: check it again
        if job.lease is not None and not self._await_lease(job):
            return _LEASE_LOST
        rc = self._counted_write(session, batch, room)
        return None if rc == 0 else f"transfer failed: write to {session} rc={rc} after " \
                                    "engine re-create"

    def _counted_write(self, session: str, batch: Entries, room: int) -> int:
        t0 = time.perf_counter()
        rc = self._backend.write(session, batch, room)
        self._stats.inc("engine_calls")
        self._stats.inc("engine_entries", len(batch))
        if rc != 0:
            self._stats.inc("engine_failures")
            log.debug("kv write rc=%d after %.3fs", rc, time.perf_counter() - t0)
        return rc

    def recreate(self) -> None:
        """Transfer thread only (or via call()): fresh engine, same registered memory."""
        self._backend.recreate()
        self._stats.inc("engine_recreations")
