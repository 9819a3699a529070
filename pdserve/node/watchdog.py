"""The scheduler process's watchdog (`--watchdog-timeout-s`, SGLang's name and default).

The scheduler loop beats once per iteration; an idle loop still beats every 100 ms, and a
decode waiting for KV every 2 ms. An iteration that makes no progress for the timeout (a
forward that never returns, a deadlock, a device that hangs) is a stuck engine that no
request timeout can cure: the watchdog logs one line, dumps every thread's stack to stderr
and exits the process with `EXIT_STUCK`. The HTTP process then sees its scheduler gone,
fails the open requests, turns `/livez` 503 and exits 1 itself, so its supervisor
(Kubernetes, `pdserve up`) restarts the node.

Two layers, because a stuck C call may hold the GIL: a Python thread that logs and dumps
the stacks at the timeout, and `faulthandler`'s own C thread, which needs no GIL, as the
backstop `BACKSTOP_S` later (it dumps the stacks and exits 1).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time

log = logging.getLogger("pdserve.scheduler")
EXIT_STUCK = 70  # EX_SOFTWARE
BACKSTOP_S = 10.0
_REARM_S = 1.0  # faulthandler is re-armed at most this often (its deadline moves by <= 1 s)


class Watchdog:
    def __init__(self, timeout_s: float) -> None:
        """`timeout_s` > 0; a node with the watchdog off makes none."""
        self.timeout_s = timeout_s
        self._beat = time.monotonic()
        self._armed_at = -float("inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-watchdog", daemon=True)
        self._thread.start()
        self.beat()

    def beat(self) -> None:
        """The loop made progress (called once per iteration; cheap)."""
        now = time.monotonic()
        self._beat = now
        if now - self._armed_at >= _REARM_S:
            self._armed_at = now
            faulthandler.dump_traceback_later(self.timeout_s + BACKSTOP_S, exit=True,
                                              file=sys.stderr)

    def _run(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            stuck = time.monotonic() - self._beat
            if stuck > self.timeout_s:
                log.critical("watchdog: the scheduler loop made no progress for %.0fs "
                             "(--watchdog-timeout-s %g); dumping stacks and exiting %d",
                             stuck, self.timeout_s, EXIT_STUCK)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(EXIT_STUCK)

    def stop(self) -> None:
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()
