"""Background heartbeat: keeps one node's record alive in the registry.

Every beat is a full PUT of the record with the node's current load, so a registry that
lost the record (memory store restarted, Redis flushed, TTL missed during a stall) gets
it back on the next beat; the registry answers 201 then, which is counted and logged.
When the registry is unreachable the thread retries with jittered exponential backoff
(capped at the normal interval, so the record comes back within one interval of the
registry's return). The thread stops for good only when told to, or when a newer
instance of the node has replaced this one (409).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bootstrap.backoff import Backoff
from bootstrap.client_errors import NodeSuperseded, RegistryError
from bootstrap.record import NodeLoad, RegisteredNode

log = logging.getLogger("pdserve.registry.client")

PutFn = Callable[[dict[str, Any]], tuple[RegisteredNode, bool]]
LoadFn = Callable[[], "NodeLoad | Mapping[str, Any]"]

DEFAULT_BACKOFF_BASE_S = 0.2


@dataclass
class HeartbeatStats:
    beats: int = 0  # successful PUTs, the first registration included
    failures: int = 0
    consecutive_failures: int = 0
    reregistrations: int = 0  # beats answered 201 after we had been registered
    last_success: float | None = None  # time.monotonic()
    last_error: str | None = None
    superseded: bool = False
    retry_delays: deque[float] = field(default_factory=lambda: deque(maxlen=32))


class Heartbeat:
    def __init__(
        self,
        put: PutFn,
        payload: dict[str, Any],
        *,
        load_fn: LoadFn | None = None,
        interval_s: float | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self._put, self._payload, self._load_fn = put, dict(payload), load_fn
        self._fixed_interval = interval_s
        self._interval = interval_s or float(payload.get("ttl_s") or 10.0) / 3
        self._backoff = backoff or Backoff(
            DEFAULT_BACKOFF_BASE_S, max(DEFAULT_BACKOFF_BASE_S, self._interval)
        )
        self._auto_cap = backoff is None
        self._stats = HeartbeatStats()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.node: RegisteredNode | None = None  # the registry's last answer

    @property
    def interval_s(self) -> float:
        return self._interval

    def stats(self) -> HeartbeatStats:
        with self._lock:
            return copy.deepcopy(self._stats)

    def beat_once(self) -> RegisteredNode:
        """One PUT with the current load; raises RegistryError subclasses."""
        payload = dict(self._payload, load=self._current_load())
        try:
            node, created = self._put(payload)
        except RegistryError as exc:
            with self._lock:
                self._stats.failures += 1
                self._stats.consecutive_failures += 1
                self._stats.last_error = str(exc)
                self._stats.superseded = isinstance(exc, NodeSuperseded)
            raise
        with self._lock:
            if created and self._stats.beats > 0:
                self._stats.reregistrations += 1
                log.warning("registry had lost node %s; registered it again", node.node_id)
            self._stats.beats += 1
            self._stats.consecutive_failures = 0
            self._stats.last_success = time.monotonic()
        self.node = node
        self._backoff.reset()
        # The registry may have clamped or defaulted ttl_s: renew at a third of what it
        # actually applies, so two beats can be lost before the record expires.
        self._interval = self._fixed_interval or node.ttl_s / 3
        if self._auto_cap:
            self._backoff.cap_s = max(self._backoff.base_s, self._interval)
        return node

    def start(self, registered: bool) -> None:
        """Run the loop in a daemon thread; `registered`: the first beat already landed."""
        if self._thread is not None:
            raise RuntimeError("heartbeat already started")
        first = self._interval if registered else self._backoff.next_delay()
        self._thread = threading.Thread(
            target=self._run, args=(first,), name="registry-heartbeat", daemon=True
        )
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self, delay: float) -> None:
        while not self._stop.wait(delay):
            try:
                self.beat_once()
                delay = self._interval
            except NodeSuperseded as exc:
                log.error("stopping heartbeat: %s", exc)
                return
            except RegistryError as exc:
                delay = self._backoff.next_delay()
                with self._lock:
                    self._stats.retry_delays.append(delay)
                    first = self._stats.consecutive_failures == 1
                (log.warning if first else log.debug)(
                    "heartbeat failed (%s); retrying in %.2fs", exc, delay
                )
            except Exception:  # a bug must not silently end the node's registration
                log.exception("heartbeat error")
                delay = self._backoff.next_delay()

    def _current_load(self) -> dict[str, Any]:
        previous = self._payload.get("load") or {}
        if self._load_fn is None:
            return previous
        try:
            load = self._load_fn()
            # Lax here: a callback may well hand over numpy scalars.
            data = (
                load if isinstance(load, NodeLoad) else NodeLoad.model_validate(load, strict=False)
            )
            self._payload["load"] = data.model_dump(mode="json")
        except Exception:
            log.exception("load callback failed; reporting the previous load")
        return self._payload.get("load") or previous
