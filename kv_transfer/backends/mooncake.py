"""Mooncake transfer engine backend (RDMA, or Mooncake's own TCP transport).

Facts this code relies on (measured with mooncake-transfer-engine-non-cuda 0.3.13.post1):
- the pybind API never raises; it returns codes (0 = ok);
- `batch_transfer_sync_write` blocks the calling thread (busy-spinning a core on a frozen
  peer) for up to MC_TRANSFER_TIMEOUT seconds, so only the manager's transfer thread
  calls it, and the timeout comes from our config;
- a batch above 2048 entries, or large batches from concurrent threads, poison the
  engine->peer path for good (kvcache-ai/Mooncake#4209); `send_probe` still succeeds on
  such a path, and re-creating the engine and re-registering memory cures it;
- the engine listens on 0.0.0.0 whatever host it is given (two ports in 15000-17000);
- "rdma" initializes without an RDMA NIC and silently uses TCP: rc 0 proves nothing;
- the sync batch write waits for completion in a tight loop: the waiting thread keeps a
  core busy for the whole write, a core the engine's own I/O threads and the peer's
  receiving threads need on a small machine (measured in a 1P1D stack on a 2-core VM, a
  64 KiB write of 9 entries: p50 1.2-1.5 ms, p90 3.3-3.8 ms). So a batch of at most
  `POLL_MAX_ENTRIES` entries (any request-sized write of a small model) is submitted as
  one-entry async writes and waited for by polling with yields (same write: p50 0.7-0.8 ms,
  p90 0.9-1.3 ms); `transfer_check_status` reads a batch's first task only, hence one entry
  per submit. Larger batches keep the sync call: their per-entry polling would cost more
  CPU than the spin. Either way nothing of a batch is still in flight when `write`
  returns, except after the engine's own timeout, as before.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from kv_transfer.backends.base import BackendUnavailable, TransferBackend
from kv_transfer.config import KVTransferConfig
from kv_transfer.runs import Entries

log = logging.getLogger(__name__)
_MAX_RETIRED = 4
POLL_MAX_ENTRIES = 128  # batches up to this size are polled, not spun on (module doc)
_YIELDS = 8  # polls answered by sched_yield before the waits become sleeps
_POLL_SLEEP_S = 50e-6
_NO_BATCH = (0, -1, 2**64 - 1)  # no batch: its failure answer (uint64 -1) or a null id


def set_mooncake_env(config: KVTransferConfig | None = None) -> None:
    """Set Mooncake's own knobs from our config. Must run before mooncake is first
    imported (its logging is configured at import) and before an engine is created."""
    os.environ["MC_LOG_LEVEL"] = "ERROR"
    if config is not None:
        os.environ["MC_TRANSFER_TIMEOUT"] = str(max(1, math.ceil(config.transfer_timeout_s)))


def _engine_class(config: KVTransferConfig) -> Any:
    set_mooncake_env(config)
    try:
        from mooncake.engine import TransferEngine
    except Exception as exc:  # ImportError, or OSError when libibverbs.so.1 is missing
        raise BackendUnavailable(
            f"mooncake backend unavailable ({type(exc).__name__}: {exc}); install "
            "mooncake-transfer-engine-non-cuda and Debian's libibverbs1, or use the tcp "
            "backend (--transfer-backend tcp)") from exc
    return TransferEngine


class MooncakeBackend(TransferBackend):
    name = "mooncake"

    def __init__(self, config: KVTransferConfig) -> None:
        self._config = config
        self._cls = _engine_class(config)
        if config.mooncake_protocol == "rdma" and not self._has_rdma_device():
            log.warning("mooncake protocol 'rdma' requested but no RDMA device is present; "
                        "Mooncake will silently fall back to its TCP transport")
        self._regions: list[tuple[int, int]] = []
        self._engine: Any = None
        self._retired: list[Any] = []
        self._session = ""
        self._start_engine()

    @staticmethod
    def _has_rdma_device() -> bool:
        root = Path("/sys/class/infiniband")
        return root.is_dir() and any(root.iterdir())

    def _start_engine(self) -> None:
        engine = self._cls()
        cfg = self._config
        rc = engine.initialize(cfg.host, "P2PHANDSHAKE", cfg.mooncake_protocol, cfg.device_name)
        if rc != 0:
            raise BackendUnavailable(f"mooncake engine initialize failed (rc={rc})")
        if self._regions:
            self._register_on(engine, self._regions)
        self._engine = engine
        self._session = f"{cfg.host}:{engine.get_rpc_port()}"

    @staticmethod
    def _register_on(engine: Any, regions: list[tuple[int, int]]) -> None:
        rc = engine.batch_register_memory([p for p, _ in regions], [n for _, n in regions])
        if rc != 0:
            raise RuntimeError(f"mooncake batch_register_memory failed (rc={rc})")

    @property
    def session(self) -> str:
        return self._session

    def register(self, regions: list[tuple[int, int]]) -> None:
        self._register_on(self._engine, regions)
        self._regions.extend(regions)

    def write(self, session: str, entries: Entries, room: int | None = None) -> int:
        if not len(entries):
            return 0
        if len(entries) <= POLL_MAX_ENTRIES:
            return self._write_polled(session, entries)
        return int(self._engine.batch_transfer_sync_write(session, entries.src, entries.dst,
                                                          entries.lens))

    def _write_polled(self, session: str, entries: Entries) -> int:
        """The batch as one-entry async writes, waited for without spinning a core. Every
        submitted write is waited for, even after one failed, so none lands after we
        return (a failed room's pages may be reused at once)."""
        engine = self._engine
        ids: list[int] = []
        rc = 0
        for src, dst, n in zip(entries.src, entries.dst, entries.lens, strict=True):
            batch = engine.transfer_submit_write(session, src, dst, n)
            if batch in _NO_BATCH:
                rc = -1
                break
            ids.append(batch)
        # Mooncake's own sync wait: its timeout plus one second per GiB.
        deadline = time.monotonic() + max(5.0, self._config.transfer_timeout_s) + \
            entries.nbytes / 2**30
        polls = 0
        for batch in ids:
            # 1: done, 0: pending, -1: failed (both freed by the call); -2: timed out.
            while (state := engine.transfer_check_status(batch)) == 0:
                if time.monotonic() > deadline:
                    return -1  # as the sync call after its timeout: the engine owns it now
                polls += 1
                if polls <= _YIELDS:
                    os.sched_yield()
                else:
                    time.sleep(_POLL_SLEEP_S)
            if state != 1:
                rc = -1
        return rc

    def probe(self, session: str) -> bool:
        return self._engine.send_probe(session) == 0

    def recreate(self) -> None:
        old, self._engine = self._engine, None
        if old is not None and self._regions:
            old.batch_unregister_memory([p for p, _ in self._regions])
        # Destroying an engine holds the GIL for ~1 s (pybind destructor joining its
        # threads), which would freeze the node's control thread and scheduler. Park the
        # old engine instead; a few parked engines are cheap and recovery is rare.
        if old is not None:
            self._retired.append(old)
        while len(self._retired) > _MAX_RETIRED:
            self._retired.pop(0)  # the stall is accepted only past this bound
        self._start_engine()

    def close(self) -> None:
        engines = [*self._retired, self._engine]
        self._retired, self._engine = [], None
        for engine in engines:
            if engine is not None and self._regions:
                engine.batch_unregister_memory([p for p, _ in self._regions])
        engines.clear()  # destructors run here (~1 s each, GIL held): shutdown only

    def raw_engine(self) -> Any:
        """The pybind engine itself (benchmarks; only from the transfer thread)."""
        return self._engine
