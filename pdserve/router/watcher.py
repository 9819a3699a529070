"""Keeps the node table in step with the registry: one read every `--registry-poll-s`,
and an early read when a request finds no usable node (a node that just registered
should not wait for the next tick). While the registry is unreachable the last table
stays in use: nodes keep serving and their breakers still guard against dead ones. A
registry that comes back empty (its store's epoch changed) does not empty the table
either: see NodeTable.update.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from bootstrap.client import RegistryClient
from bootstrap.client_errors import RegistryError
from pdserve.router.config import RouterConfig
from pdserve.router.nodes import NodeTable

log = logging.getLogger("pdserve.router")
MIN_EARLY_READ_GAP_S = 0.2  # many requests finding no node trigger one read, not many


class RegistryWatcher:
    def __init__(self, cfg: RouterConfig, table: NodeTable,
                 on_update: Callable[[], None] = lambda: None) -> None:
        self.cfg, self.table, self.on_update = cfg, table, on_update
        # No client-side caching: the router's own poll interval is the cache.
        self.client = RegistryClient(cfg.registry, token=cfg.registry_token or None,
                                     timeout_s=2.0, cache_ttl_s=0.0, stale_ok_s=0.0)
        self.last_error = ""
        self.last_read = 0.0  # time.monotonic() of the last successful read
        self._lock = asyncio.Lock()

    def outage_s(self) -> float:
        """How long the registry has been unreachable (0: its last read worked)."""
        return self.client.outage_s() if self.last_error else 0.0

    @property
    def connected(self) -> bool:
        return self.last_read > 0 and not self.last_error

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.cfg.registry_poll_s)

    async def refresh(self) -> None:
        async with self._lock:
            await self._read()

    async def refresh_soon(self) -> None:
        """An early read unless one finished moments ago (or is running: wait for it)."""
        async with self._lock:
            if time.monotonic() - self.last_read >= MIN_EARLY_READ_GAP_S:
                await self._read()

    async def _read(self) -> None:
        try:
            records = await asyncio.to_thread(self.client.list_nodes, None, fresh=True)
        except RegistryError as exc:
            if not self.last_error:
                log.warning("registry unreachable (%s); keeping the last node list", exc)
            self.last_error = str(exc)
            return
        if self.last_error:
            log.info("registry reachable again")
        self.last_error = ""
        self.last_read = time.monotonic()
        self.table.update(records, self.client.epoch)
        self.on_update()

    def close(self) -> None:
        self.client.close()
