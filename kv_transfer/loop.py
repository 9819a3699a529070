"""The control thread shared by both roles.

It owns the ZMQ control sockets (ZMQ sockets are not thread-safe) and all room tables:
other threads never touch them, they `post()` closures that run here. A self-pipe
(kv_transfer/wake.py) wakes the poller, so posts are acted on at once; `on_tick` runs at
least every `tick_s` to enforce deadlines and heartbeats.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable

import zmq

from kv_transfer.wake import Wake

log = logging.getLogger(__name__)
_MAX_BURST = 256  # messages drained per socket per wake-up, so ticks are never starved


class ControlLoop:
    def __init__(self, name: str, tick_s: float) -> None:
        self.ctx = zmq.Context()
        self._tick_s = tick_s
        self._poller = zmq.Poller()
        self._sockets: dict[zmq.Socket, Callable[[list[bytes]], None]] = {}
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._pipe = Wake()  # a post() wakes the poller
        self._poller.register(self._pipe.fileno(), zmq.POLLIN)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add_socket(self, sock: zmq.Socket, handler: Callable[[list[bytes]], None]) -> None:
        """Control thread (or before start) only."""
        self._sockets[sock] = handler
        self._poller.register(sock, zmq.POLLIN)

    def post(self, fn: Callable[[], None]) -> None:
        """Run fn on the control thread soon; callable from any thread."""
        # Queued first, so the wake-up finds it. After stop() closed the pipe the call
        # never runs (as the loop has ended).
        self._calls.put(fn)
        self._pipe.notify()

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            timeout_ms = max(0.0, next_tick - time.monotonic()) * 1000
            ready = dict(self._poller.poll(math.ceil(timeout_ms)))
            if self._pipe.fileno() in ready:
                self._pipe.drain()
            self._run_calls()
            for sock in [s for s in self._sockets if s in ready]:
                self._drain_socket(sock)
            now = time.monotonic()
            if now >= next_tick:
                self._guarded(functools.partial(self.on_tick, now))
                next_tick = now + self._tick_s
        self._run_calls()
        for sock in list(self._sockets):
            sock.close(0)
        self.ctx.term()

    def _run_calls(self) -> None:
        while True:
            try:
                fn = self._calls.get_nowait()
            except queue.Empty:
                return
            self._guarded(fn)

    def _drain_socket(self, sock: zmq.Socket) -> None:
        handler = self._sockets[sock]
        for _ in range(_MAX_BURST):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._guarded(functools.partial(handler, frames))
            if sock not in self._sockets:
                return

    @staticmethod
    def _guarded(fn: Callable[[], None]) -> None:
        # A bug or a hostile message must cost one room at most, never the node's loop.
        try:
            fn()
        except Exception:
            log.exception("kv control loop: unexpected error")

    def on_tick(self, now: float) -> None:
        """Deadlines and heartbeats; override."""

    def stop(self, timeout: float = 10.0) -> bool:
        self._stop.set()
        self.post(lambda: None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            return False  # leave the pipe open: the thread may still read it
        self._pipe.close()
        return True
