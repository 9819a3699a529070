"""Tracing off (no --otlp-traces-endpoint, the default) costs nothing: the router and the
node's HTTP process never import OpenTelemetry's SDK or exporter, make no span for a
request that carries a traceparent, send nothing traced to the scheduler, and the
scheduler ships no trace field (docs/architecture.md: Tracing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = r'''
import sys, types
from pdserve.router.config import RouterConfig
from pdserve.router.gateway import Gateway
import pdserve.router.server, pdserve.node.launcher, pdserve.node.api
from pdserve.node.config import ServerConfig
from pdserve.node.frontend import Frontend
from pdserve.node.messages import GenerateRequest
from pdserve.node.scheduler_process import SchedulerService

gw = Gateway(RouterConfig())
tp = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
flow = gw.flow("r1", [1, 2], {"max_new_tokens": 1}, None, (tp, 0))
assert gw.tracer is None and gw.dispatcher.tracer is None
assert flow.span is None and flow.tracer is None
front = Frontend(ServerConfig(), None, None, None)
assert front.tracer is None
assert GenerateRequest("x", [1], {}).traced is False
req = types.SimpleNamespace(rid="x", output_ids=[7], cached_tokens=0, error=None,
                            error_code=None, trace=None,
                            params=types.SimpleNamespace(logprobs=None, prompt_logprobs=None))
assert "trace" not in SchedulerService._update(req, 0, None)
loaded = sorted(m for m in sys.modules
                if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter",
                                 "pdserve.tracing.otel")))
assert not loaded, loaded
print("ok")
'''


def test_tracing_off_loads_no_sdk_and_makes_no_span():
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
