"""Timestamps of one traced request in the scheduler process (docs/architecture.md: Tracing).

The scheduler process never imports OpenTelemetry: the engine and the roles record spans
here as plain `[name, start_ns, end_ns, attributes]` lists (wall clock, `time.time_ns()`,
so they line up with the HTTP processes' spans on the same host), and the scheduler loop
ships them in the request's next `TokenUpdate` (msgpack: ints, strings, a str-keyed map).
The node's HTTP process turns them into child spans of its request span. A request that
carries no sampled trace context has no `Timeline` at all (`Req.trace is None`), so an
untraced request costs one `is None` test per hook.
"""

from __future__ import annotations

import time
from collections import deque

now_ns = time.time_ns


class Timeline:
    """The spans and pending start times of one request (scheduler process only)."""

    __slots__ = ("spans", "marks", "forwards", "sends")

    def __init__(self) -> None:
        self.spans: list[list] = []  # finished spans not shipped yet
        self.marks: dict[str, int] = {"arrived": now_ns()}
        # Start times of launched chunks whose result is not processed yet: first in, first
        # out (under the overlap loop two chunks of one request may be in flight).
        self.forwards: deque[tuple[int, int]] = deque()  # (start_ns, tokens)
        self.sends: list[tuple[int, int]] = []  # (start_ns, pages) per KV send, in order

    def mark(self, key: str) -> int:
        t = self.marks[key] = now_ns()
        return t

    def span(self, name: str, start_ns: int, end_ns: int, **attrs: int | str) -> None:
        self.spans.append([name, int(start_ns), int(end_ns), attrs])

    def span_since(self, name: str, mark: str, **attrs: int | str) -> int:
        """A span from `marks[mark]` (or arrival) to now; returns now."""
        end = now_ns()
        self.span(name, self.marks.get(mark, self.marks["arrived"]), end, **attrs)
        return end

    @staticmethod
    def wall_ns(monotonic_s: float) -> int:
        """A `time.monotonic()` instant of this process (a transfer thread's) as wall ns."""
        return now_ns() - int((time.monotonic() - monotonic_s) * 1e9)

    def take(self) -> list[list]:
        """The spans recorded since the last call (shipped with a TokenUpdate)."""
        out, self.spans = self.spans, []
        return out
