"""The one module that imports the OpenTelemetry SDK (docs/architecture.md: Tracing).

`Tracer` is what the router and a node's HTTP process hold when `--otlp-traces-endpoint` is
set: it starts spans with explicit times, extracts the W3C `traceparent` of an incoming
request and injects it into outgoing ones, so the router and the nodes write one trace per
request. Spans go out in batches over OTLP/HTTP (protobuf) from the SDK's export thread.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

# Spans leave every 200 ms rather than the SDK's 5 s: a load test reading them right after
# its run (`pdserve bench --trace-breakdown`) then waits a fraction of a second, and the
# export thread's cost stays one small POST per period.
EXPORT_DELAY_MS = 200


class Tracer:
    def __init__(self, url: str, service: str, exporter: SpanExporter | None = None) -> None:
        # Sampled unless the caller's traceparent says otherwise (its flags are honoured).
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}),
                                       sampler=ParentBased(ALWAYS_ON))
        self.provider.add_span_processor(BatchSpanProcessor(
            exporter or OTLPSpanExporter(endpoint=url), schedule_delay_millis=EXPORT_DELAY_MS))
        self._tracer = self.provider.get_tracer("pdserve")
        self._propagator = TraceContextTextMapPropagator()

    def server_span(self, name: str, headers: Mapping[str, str] | None,
                    start_ns: int | None = None, **attrs: str | int) -> Span:
        """The span of a request this process received: a child of the caller's
        `traceparent` when it sent one, else the root of a new trace. A caller's context
        that is not sampled gives a span that records nothing (`is_recording()` False), and
        is still passed on, so the next hop does not sample either."""
        ctx = self._propagator.extract(headers) if headers is not None else None
        return self._tracer.start_span(name, context=ctx, kind=SpanKind.SERVER,
                                       start_time=start_ns, attributes=attrs or None)

    def child(self, parent: Span, name: str, start_ns: int, end_ns: int | None = None,
              **attrs: str | int) -> Span:
        """A span under `parent` that began at `start_ns`; ended at `end_ns` when given."""
        span = self._tracer.start_span(name, context=trace.set_span_in_context(parent),
                                       start_time=start_ns, attributes=attrs or None)
        if end_ns is not None:
            span.end(end_time=max(end_ns, start_ns))
        return span

    def record(self, parent: Span, spans: list[list]) -> None:
        """Spans the scheduler process recorded (`pdserve.tracing.marks`), under `parent`."""
        for name, start, end, attrs in spans:
            self.child(parent, str(name), int(start), int(end), **attrs)

    def headers(self, span: Span) -> dict[str, str]:
        """`traceparent` (and `tracestate`) naming `span`, for a request sent on its behalf."""
        out: dict[str, str] = {}
        self._propagator.inject(out, context=trace.set_span_in_context(span))
        return out

    @staticmethod
    def end(span: Span, error: str | None = None, **attrs: str | int) -> None:
        if attrs:
            span.set_attributes(attrs)
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def shutdown(self) -> None:
        """Export what is left (bounded by the SDK's timeout) and stop the export thread."""
        self.provider.shutdown()
