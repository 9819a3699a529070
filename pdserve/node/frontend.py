"""One request's life in the HTTP process: submit, receive token updates, detokenize,
time, and abort on disconnect or timeout. Role-agnostic; the routes format the events."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.http.detokenizer import IncrementalDetokenizer
from pdserve.http.errors import ApiError
from pdserve.node import messages as m
from pdserve.node.config import ServerConfig
from pdserve.node.engine_client import EngineClient
from pdserve.node.metrics import Metrics
from pdserve.pd.leg import PDLegFields
from pdserve.prompt_check import PromptError, check_prompt_ids
from pdserve.tracing import make_tracer

if TYPE_CHECKING:
    from opentelemetry.trace import Span

DISCONNECT_CHECK_S = 0.5


@dataclass(frozen=True)
class TraceStart:
    """What a route knows of a request's trace: its headers (`traceparent`), when it
    arrived and when its PD leg was resolved (`time.time_ns()`; 0: no leg)."""

    headers: Mapping[str, str]
    received_ns: int
    resolved_ns: int = 0


@dataclass
class Event:
    rid: str
    delta: str  # new visible text
    text: str  # all visible text so far
    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str | None
    # When asked (docs/architecture.md: Logprobs): entries of all output ids so far, and of
    # prompt tokens 1.. (see pdserve.http.logprob_format).
    output_logprobs: list | None = None
    prompt_logprobs: list | None = None


class Frontend:
    def __init__(self, cfg: ServerConfig, client: EngineClient, tokenizer, metrics: Metrics):
        self.cfg = cfg
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.client_rids: set[str] = set()  # client-given rids of open requests
        self.leg_resolver = None  # decode nodes: resolves prefill_node_id (registration.py)
        self.bootstrap_port: int | None = None  # prefill nodes: SGLang bootstrap endpoint
        self.draining = False  # set on SIGTERM (drain.py): new requests get 503 "draining"
        # None unless --otlp-traces-endpoint: no OpenTelemetry module is loaded then.
        self.tracer = make_tracer(cfg.otlp_traces_endpoint, f"pdserve-{cfg.role}")

    async def resolve_leg(self, given: dict) -> PDLegFields | None:
        """A body's PD leg fields (None: no leg), parsed once and completed (decode: the
        prefill's KV endpoints). Other nodes need no bootstrap address: a prefill is
        itself the one it names."""
        if not given:
            return None
        try:
            leg = PDLegFields.from_wire(given)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        if self.leg_resolver is not None and self.cfg.role == "decode":
            return await self.leg_resolver.resolve(leg)
        if self.cfg.role == "prefill" and self.bootstrap_port is None and (
                leg.bootstrap_host is not None or leg.bootstrap_port is not None):
            # SGLang's router: its decode worker would look for our bootstrap endpoint,
            # find none, and this leg would wait out the whole bootstrap timeout.
            raise ApiError(400, "this prefill node serves no SGLang bootstrap endpoint, so "
                                "the decode worker named with bootstrap_host/bootstrap_port "
                                "cannot find it: start the node with "
                                "--disaggregation-bootstrap-port PORT (the port given to "
                                "SGLang's router with --prefill URL PORT)",
                           "bootstrap_unavailable")
        # Other nodes need no bootstrap address; nothing left: no leg (e.g. n > 1 allowed).
        rest = leg.without_bootstrap_address()
        return None if rest == PDLegFields() else rest

    @property
    def context_length(self) -> int:
        return self.client.info.context_length

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            try:
                ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            except (TypeError, ValueError) as exc:  # the client's text, not our bug
                raise ApiError(400, f"cannot tokenize the prompt: {exc}") from exc
        else:
            ids = list(prompt)
        self.check_ids(ids)
        return ids

    def check_ids(self, ids: list[int]) -> None:
        try:
            check_prompt_ids(ids, self.client.info.vocab_size, self.context_length)
        except PromptError as exc:
            raise ApiError(400, exc.message, exc.code) from None

    def default_max_tokens(self, ids: list[int]) -> int:
        return max(1, min(self.context_length, self.client.info.max_total_tokens) - len(ids))

    async def run(self, ids: list[int], sampling: dict, rid: str | None = None,
                  leg: PDLegFields | None = None, disconnected=None,
                  trace: TraceStart | None = None) -> AsyncGenerator[Event, None]:
        """Yield an Event per token update until finished. Raises ApiError (400/408/429/503).
        `disconnected` (an async callable, the HTTP request's) is polled while waiting.
        `trace`: the request's trace context, used when tracing is on."""
        # The scheduler only ever sees an internal id: a client's rid is a label, and two
        # requests must never share one routing key (late updates of an old one would leak).
        if self.draining:  # routers retry "draining" elsewhere and stop picking us
            raise ApiError(503, "this node is draining (shutting down)", "draining")
        if rid is not None and rid in self.client_rids:
            raise ApiError(400, f"duplicate request id {rid!r}: a request with it is running")
        internal = uuid.uuid4().hex
        rid = rid or internal
        t0 = time.perf_counter()
        deadline = t0 + self.cfg.request_timeout_s
        stop = sampling.get("stop")
        self.client_rids.add(rid)
        span = self._request_span(trace, rid, len(ids)) if trace is not None else None
        traced = span is not None and span.is_recording()
        try:
            handle = await self.client.submit(m.GenerateRequest(
                internal, ids, sampling, leg.to_wire() if leg else {}, traced))
        except BaseException as exc:
            self.client_rids.discard(rid)
            self._end_span(span, exc)
            raise
        detok = IncrementalDetokenizer(self.tokenizer, [stop] if isinstance(stop, str) else stop)
        last, first, done = t0, None, False
        out_lp: list | None = None
        prompt_lp: list | None = None
        next_check = t0 + DISCONNECT_CHECK_S
        kv_in = 0  # traced decode node: when the KV arrived (end of "decode receive")
        failure: BaseException | None = None
        try:
            while not done:
                u = await self._next_update(handle, deadline, disconnected)
                if disconnected is not None and time.perf_counter() >= next_check:
                    # Updates may keep coming every step: check the client on a timer too.
                    next_check = time.perf_counter() + DISCONNECT_CHECK_S
                    if await disconnected():
                        u = None
                if u is None:  # client went away
                    return
                if u.error:
                    # A prefill node's failure is not this node's: 503 with its code. A
                    # grammar that does not compile is the client's: 400.
                    status = 503 if u.error_code in ("prefill_failed", "node_failed") or \
                        u.finish_reason != "error" else 500
                    status = 400 if u.error_code == "invalid_grammar" else status
                    raise ApiError(status, u.error, u.error_code)
                if traced and u.trace:
                    kv_in = self._record(span, u.trace) or kv_in
                now = time.perf_counter()
                if u.new_ids:
                    if first is None and kv_in and self.tracer is not None and span is not None:
                        # KV arrived -> the first token is here, in the HTTP process.
                        self.tracer.child(span, "decode first token", kv_in, time.time_ns())
                    if first is None:
                        first = now
                        self.metrics.ttft.observe(now - t0)
                    else:
                        self.metrics.itl.observe((now - last) / len(u.new_ids))
                    last = now
                done = u.finish_reason is not None
                delta = detok.add(u.new_ids, done)
                if u.logprobs is not None:
                    out_lp = (out_lp or []) + [_entry(e) for e in u.logprobs]
                if u.prompt_logprobs is not None:
                    prompt_lp = [_entry(e) for e in u.prompt_logprobs]
                yield Event(rid, delta, detok.emitted, list(detok.ids), len(ids), u.cached_tokens,
                            u.finish_reason, out_lp, prompt_lp)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self._end_span(span, failure if failure is not None or done else "aborted")
            self.client_rids.discard(rid)
            if not done:  # disconnect, timeout or error: still counted
                self.metrics.requests.labels("abort").inc()
                # Shielded: this may run in a response cancelled because its client left,
                # where an unshielded await that has to wait would drop the abort.
                await asyncio.shield(self.client.abort(internal))
            self.client.release(internal)
        assert u is not None  # the loop returned on None
        self._observe_end(t0, first, len(ids), len(detok.ids), u.finish_reason)

    def _request_span(self, trace: TraceStart, rid: str, n_prompt: int) -> Span | None:
        """This node's span of the request (a child of the router's), None when off."""
        if self.tracer is None:
            return None
        span = self.tracer.server_span(f"{self.cfg.role} request", trace.headers,
                                       trace.received_ns, rid=rid, prompt_tokens=n_prompt)
        if trace.resolved_ns and self.cfg.role == "decode" and span.is_recording():
            # the prefill's KV endpoints looked up (registry.py: PrefillPeerResolver)
            self.tracer.child(span, "leg resolve", trace.received_ns, trace.resolved_ns)
        return span

    def _record(self, span: Span | None, spans: list) -> int:
        """The scheduler's spans of this request under `span`; returns the end of its
        "decode receive" span (the KV's arrival) when among them, else 0."""
        assert self.tracer is not None and span is not None  # only traced requests ship spans
        self.tracer.record(span, spans)
        return next((int(s[2]) for s in spans if s[0] == "decode receive"), 0)

    def _end_span(self, span: Span | None, failure: BaseException | str | None) -> None:
        if span is None or self.tracer is None:
            return
        if isinstance(failure, GeneratorExit | asyncio.CancelledError):
            failure = "aborted"  # the client (the router) left
        elif isinstance(failure, BaseException):
            failure = getattr(failure, "message", None) or type(failure).__name__
        self.tracer.end(span, failure)

    async def _next_update(self, handle, deadline: float, disconnected) -> m.TokenUpdate | None:
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise ApiError(408, f"request timed out after {self.cfg.request_timeout_s:g}s",
                               "timeout")
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancellation
                # (the client left) that lands as an update arrives, and the stream would
                # then run on to the end, the request never aborted.
                async with asyncio.timeout(min(remaining, DISCONNECT_CHECK_S)):
                    return await handle.updates.get()
            except TimeoutError:
                if disconnected is not None and await disconnected():
                    return None

    def _observe_end(self, t0, first, n_prompt, n_out, reason) -> None:
        end = time.perf_counter()
        self.metrics.e2e.observe(end - t0)
        if first is not None and n_out > 1:
            self.metrics.tpot.observe((end - first) / (n_out - 1))
        self.metrics.prompt_tokens.inc(n_prompt)
        self.metrics.generation_tokens.inc(n_out)
        self.metrics.requests.labels(reason or "unknown").inc()


def _entry(e):
    """A logprob entry off msgpack (lists) as the engine's (logprob, [(id, logprob)])."""
    return None if e is None else (e[0], [(a, lp) for a, lp in e[1]])
