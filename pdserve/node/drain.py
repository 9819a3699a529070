"""The node's uvicorn server with a graceful drain (docs/architecture.md: Node server).

On the first SIGTERM a PD node does not stop listening at once. `drain()` (launcher.py)
runs first: it marks the node draining (new requests get 503 "draining", /readyz 503),
deregisters it so routers stop picking it, and waits until its open requests finished or
`--drain-timeout-s` passed. Only then does uvicorn's own shutdown start (close the port,
end idle connections, lifespan exit). A second SIGTERM, or SIGINT, stops at once as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Awaitable, Callable

import uvicorn

from pdserve.http.listening import ListeningServer

log = logging.getLogger("pdserve.node")


class NodeServer(ListeningServer):
    def __init__(self, config: uvicorn.Config, sock: socket.socket, port_file: str | None,
                 drain: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(config, sock, port_file, log)
        self._drain = drain
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises a captured SIGTERM/SIGINT after a graceful shutdown, which would
        # kill us before the scheduler process is joined and the IPC folder removed. We
        # already shut down gracefully, so the signal has done its job: do not re-raise it.
        with super().capture_signals():
            yield
            self._captured_signals.clear()

    def handle_exit(self, sig: int, frame) -> None:
        # Runs in the signal handler: only set a flag; on_tick starts the drain task.
        if (self._drain is not None and sig == signal.SIGTERM and not self._drain_requested
                and not self.should_exit):
            self._drain_requested = True
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._run_drain())
        if self._drain_task is not None and self._drain_task.done():
            self.should_exit = True
        return await super().on_tick(counter)

    async def _run_drain(self) -> None:
        assert self._drain is not None
        try:
            await self._drain()
        except Exception:  # a failed drain must still let the server stop
            log.exception("drain failed; shutting down now")


async def wait_drained(open_requests: Callable[[], int], grace_s: float,
                       timeout_s: float, poll_s: float = 0.1) -> int:
    """Wait at least `grace_s`, then until `open_requests()` is 0 or `timeout_s` has passed
    (counted from the start). Returns the requests still open."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        elapsed = loop.time() - start
        left = open_requests()
        if elapsed >= grace_s and (left == 0 or elapsed >= timeout_s):
            return left
        await asyncio.sleep(poll_s)
