"""A small OTLP/HTTP trace receiver on loopback for `pdserve bench --trace-breakdown`
(docs/architecture.md: Tracing).

The servers under test were started with `--otlp-traces-endpoint http://HOST:PORT` naming
it; they POST protobuf `ExportTraceServiceRequest`s to `/v1/traces`, which this decodes
(`opentelemetry-proto`, the `trace` extra) into `SpanRecord`s grouped by trace id. A plain
threaded HTTP server: the bench's event loop is never blocked by it.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pdserve.loadtest.trace_breakdown import SpanRecord

MAX_BODY = 64 << 20


def _value(v) -> object:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind in ("string_value", "int_value", "bool_value",
                                        "double_value") else None


def decode_export(body: bytes) -> list[SpanRecord]:
    """The spans of one OTLP/HTTP protobuf export request."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(SpanRecord(
                    s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name,
                    s.start_time_unix_nano, s.end_time_unix_nano,
                    {a.key: _value(a.value) for a in s.attributes}))
    return out


class SpanReceiver:
    def __init__(self, host: str, port: int) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # fail early

        self._ok = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.host, self.port = host, port
        self._lock = threading.Lock()
        self._spans: dict[str, list[SpanRecord]] = defaultdict(list)
        self._last_at = 0.0  # monotonic time of the last span received
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> int:
        """Listen (raises OSError when the port is taken); returns the bound port."""
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                size = int(self.headers.get("Content-Length") or 0)
                if self.path.rstrip("/") != "/v1/traces" or not 0 < size <= MAX_BODY:
                    self.send_error(404 if size else 400)
                    return
                body = self.rfile.read(size)
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                try:
                    if encoding == "gzip":
                        body = gzip.decompress(body)
                    elif encoding == "deflate":
                        body = zlib.decompress(body)
                    receiver.add(decode_export(body))
                except Exception:  # a bad export is the sender's problem, not the bench's
                    self.send_error(400)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(receiver._ok)))
                self.end_headers()
                self.wfile.write(receiver._ok)

            def log_message(self, *args) -> None:  # quiet: the bench prints its own lines
                pass

        self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="otlp-receiver",
                         daemon=True).start()
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def add(self, spans: list[SpanRecord]) -> None:
        with self._lock:
            for s in spans:
                self._spans[s.trace_id].append(s)
            self._last_at = time.monotonic()

    def spans(self, trace_ids: set[str] | None = None) -> dict[str, list[SpanRecord]]:
        with self._lock:
            return {t: list(v) for t, v in self._spans.items()
                    if trace_ids is None or t in trace_ids}

    def wait_for(self, trace_ids: set[str], timeout_s: float, quiet_s: float = 1.0
                 ) -> dict[str, list[SpanRecord]]:
        """The spans of `trace_ids`, once each has some and nothing arrived for `quiet_s`
        (the servers export every 200 ms), or when `timeout_s` ran out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                have = trace_ids <= set(self._spans)
                quiet = time.monotonic() - self._last_at >= quiet_s
            if have and quiet:
                break
            time.sleep(0.1)
        return self.spans(trace_ids)
