"""Per-request OpenTelemetry traces (docs/architecture.md: Tracing), off by default.

`--otlp-traces-endpoint URL` on the router, a node or `pdserve up` turns them on. This
package stays light on purpose: `make_tracer` imports the OpenTelemetry SDK (`otel.py`)
only when an endpoint is given, so a process without one never loads it, and `marks.py`
(the scheduler process's timestamps) imports nothing at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from pdserve.tracing.otel import Tracer

# The help text of every process kind's `--otlp-traces-endpoint` (router, node, up).
ENDPOINT_HELP = ("export OpenTelemetry spans of every request over OTLP/HTTP (protobuf) to "
                 "this URL, e.g. http://127.0.0.1:4318 (a URL without a path gets "
                 "/v1/traces); needs the `trace` extra. Empty: no tracing, nothing of "
                 "OpenTelemetry's SDK is loaded")
TRACES_PATH = "/v1/traces"  # the OTLP/HTTP path of traces, when the URL names none


def endpoint_problem(url: str) -> str | None:
    """Why `url` cannot be an OTLP/HTTP endpoint (None: it can, or it is empty: off)."""
    if not url:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return "expected http://HOST:PORT[/PATH]"
    return None


def traces_url(url: str) -> str:
    """The URL spans are posted to: `url` itself, or with /v1/traces when it has no path."""
    parts = urlsplit(url)
    return url if parts.path not in ("", "/") else url.rstrip("/") + TRACES_PATH


def make_tracer(endpoint: str, service: str) -> Tracer | None:
    """A tracer exporting to `endpoint` as `service`, or None when `endpoint` is empty (the
    callers then skip every tracing step: no span, no header, no timestamp shipped)."""
    if not endpoint:
        return None
    try:
        from pdserve.tracing.otel import Tracer
    except ImportError as exc:
        raise RuntimeError(f"--otlp-traces-endpoint needs OpenTelemetry: pip install "
                           f"'pdserve[trace]' ({exc})") from None
    return Tracer(traces_url(endpoint), service)
