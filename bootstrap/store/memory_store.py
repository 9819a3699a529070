"""Embedded in-memory store: the default, for one registry process.

Expiry is judged on the monotonic clock (immune to wall-clock jumps); the epoch
timestamps in the record are for readers only. Expired records are dropped lazily on
every access, so memory holds at most the nodes seen within one TTL.
"""

from __future__ import annotations

import copy
import threading
import time
import uuid
from typing import Any

from bootstrap.lifecycle import DeleteOutcome, PutOutcome, apply_put, check_delete
from bootstrap.store.base import NodeStore


class MemoryStore(NodeStore):
    kind = "memory"

    def __init__(self) -> None:
        # node_id -> (monotonic deadline, record). One lock: the API runs handlers on a
        # thread pool, and a PUT is a read-decide-write.
        self._records: dict[str, tuple[float, dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._epoch = uuid.uuid4().hex  # a new process starts empty: a new epoch

    def epoch(self) -> str:
        return self._epoch

    def _live(self, node_id: str) -> dict[str, Any] | None:
        entry = self._records.get(node_id)
        if entry is None:
            return None
        if entry[0] <= time.monotonic():
            del self._records[node_id]
            return None
        return entry[1]

    def put(
        self, incoming: dict[str, Any], ttl_s: float, presented: str | None = None,
        issued: str = "",
    ) -> tuple[PutOutcome, dict[str, Any] | None]:
        with self._lock:
            node_id = incoming["node_id"]
            outcome, record = apply_put(self._live(node_id), incoming, ttl_s, time.time(),
                                       presented, issued)
            if record is not None:
                self._records[node_id] = (time.monotonic() + ttl_s, record)
            return outcome, copy.deepcopy(record)

    def get(self, node_id: str) -> dict[str, Any] | None:
        with self._lock:
            return copy.deepcopy(self._live(node_id))

    def list(self, role: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            now = time.monotonic()
            expired = [k for k, (deadline, _) in self._records.items() if deadline <= now]
            for node_id in expired:
                del self._records[node_id]
            records = [r for _, r in self._records.values() if role in (None, r["role"])]
            return copy.deepcopy(sorted(records, key=lambda r: r["node_id"]))

    def delete(self, node_id: str, instance_id: str | None = None,
               presented: str | None = None) -> DeleteOutcome:
        with self._lock:
            outcome = check_delete(self._live(node_id), instance_id, presented)
            if outcome is DeleteOutcome.DELETED:
                del self._records[node_id]
            return outcome

    def ping(self) -> None:
        return None
