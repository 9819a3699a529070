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
- "rdma" initializes without an RDMA NIC and silently uses TCP: rc 0 proves nothing.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

from kv_transfer.backends.base import BackendUnavailable, TransferBackend
from kv_transfer.config import KVTransferConfig
from kv_transfer.runs import Entries

log = logging.getLogger(__name__)
_MAX_RETIRED = 4


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
        return int(self._engine.batch_transfer_sync_write(session, entries.src, entries.dst,
                                                          entries.lens))

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
