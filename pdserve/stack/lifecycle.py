"""Signals of `up` and `demo`: the first SIGTERM/SIGINT raises `Stop` in the main thread
(wherever start-up or the wait loop is), later ones are ignored while the stack stops, so
a second Ctrl-C cannot cut the shutdown short and leave children behind."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


class Stop(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    stopping = False

    def handler(signum, _frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            raise Stop(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s in old:  # ignore signals for the rest (the caller stops the stack now)
            signal.signal(s, signal.SIG_IGN)
