"""Connection hygiene for every HTTP server of pdserve (node, router, registry).

uvicorn's h11 protocol, plus three bounds that uvicorn itself lacks:
- header timeout: a connection must deliver a request's complete headers within
  `header_timeout_s` of its first byte (or of the connection opening); partial headers or
  an idle fresh connection are answered 408 and closed.
- body timeout: once the headers are in, the whole body must arrive within
  `body_timeout_s`; a stalled upload is answered 408 (when no response started) and closed.
- connection limit: beyond `max_connections` open connections a new one is answered 503
  and closed at once, so stalled clients cannot pile up until the file limit.
A connection waiting for its response (a long generation) is bounded by neither timeout;
idle keep-alive connections are closed by uvicorn's keep-alive timeout as before.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.http.limits import HttpLimits

log = logging.getLogger("pdserve.http")


def _raw_error(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "timeout_error" if status == 408
                                 else "service_unavailable", "code": status}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    return head + body


def guarded_protocol(limits: HttpLimits) -> type[H11Protocol]:
    """An H11Protocol class bound to `limits`, for `uvicorn.Config(http=...)`."""

    class GuardedH11Protocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _phase: str | None = None  # "headers" | "body" while a timer runs
        _refused = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self._refuse(transport)
            else:
                self._arm("headers", limits.header_timeout_s)

        def _refuse(self, transport) -> None:
            """Answer 503 and half-close; what the client sends meanwhile is discarded
            (closing with unread bytes would reset the socket before it reads the 503)."""
            log.warning("connection limit %d reached: refusing a connection",
                        limits.max_connections)
            self._refused = True
            transport.write(_raw_error(503, "Service Unavailable", "too many connections "
                                       f"(limit {limits.max_connections})"))
            if transport.can_write_eof():
                transport.write_eof()
            self._timer = self.loop.call_later(limits.header_timeout_s, transport.close)

        def eof_received(self) -> None:
            if self._refused:
                self.transport.close()
            super().eof_received()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            self._track()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._track()

        def _track(self) -> None:
            """Arm the timer that fits the client's state after new bytes or a response."""
            if self.transport.is_closing():
                return self._disarm()
            state = self.conn.their_state
            if state is h11.IDLE and self.conn.trailing_data[0]:
                if self._phase != "headers":  # bytes of a next request: headers due
                    self._arm("headers", limits.header_timeout_s)
            elif state is h11.SEND_BODY:
                if self._phase != "body":
                    self._arm("body", limits.body_timeout_s)
            elif self._phase is not None and state is not h11.IDLE:
                self._disarm()  # request complete: its response is the app's business
            elif state is h11.IDLE and self._phase == "body":
                self._disarm()

        def _arm(self, phase: str, seconds: float) -> None:
            self._disarm()
            self._phase = phase
            self._timer = self.loop.call_later(seconds, self._expired, phase)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._phase = None, None

        def _expired(self, phase: str) -> None:
            self._timer, self._phase = None, None
            if self.transport.is_closing():
                return
            started = self.cycle is not None and self.cycle.response_started
            if phase == "headers" and self.cycle is not None and not self.cycle.response_complete:
                return  # a response is in progress on this connection: not stalled
            log.info("closing a connection whose request %s did not arrive in time", phase)
            if not started:
                timeout = limits.header_timeout_s if phase == "headers" else \
                    limits.body_timeout_s
                self.transport.write(_raw_error(408, "Request Timeout",
                                                f"request {phase} not received within "
                                                f"{timeout:g}s"))
            self.transport.close()

    return GuardedH11Protocol
