"""One client request through the router: a queue slot, a dispatched pair, the decode
leg's events as `Event`s, router-side latency metrics, migration to a new pair when the
decode node dies mid-stream (pdserve.router.migration), and a `close()` that is safe to
call from anywhere (twice, or under cancellation) and always frees the slot and stops
both legs.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.http.errors import ApiError
from pdserve.http.logprob_format import merge_prefill
from pdserve.router.admission import Admission
from pdserve.router.dispatch import Dispatcher, Opened
from pdserve.router.events import DONE, Event, StreamFormatError, to_event
from pdserve.router.legs import LegError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.migration import Stitcher, continuation, is_decode_death

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from pdserve.tracing.otel import Tracer


@dataclass(frozen=True)
class Migration:
    """What a flow needs to migrate: how often, and the tokenizer to re-derive text."""

    limit: int
    tokenizer: object | None  # a transformers tokenizer; None: never migrate


class Flow:
    def __init__(self, rid: str, ids: list[int], sampling: dict, admission: Admission,
                 dispatcher: Dispatcher, metrics: RouterMetrics, timeout_s: float,
                 migration: Migration = Migration(0, None), extra: dict | None = None,
                 tracer: Tracer | None = None, span: Span | None = None) -> None:
        self.rid, self.ids, self.sampling = rid, ids, sampling
        self.migration = migration
        self.migrations = 0
        self.dead_decodes: set[str] = set()  # decode nodes this request left (died, stalled)
        self.stitcher: Stitcher | None = None
        self.extra = extra or {}  # SGLang logprob fields for both legs
        self._prefill_meta: dict | None = None
        self.admission, self.dispatcher, self.metrics = admission, dispatcher, metrics
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + timeout_s
        self.timeout_s = timeout_s
        self.opened: Opened | None = None
        self.first_token_at: float | None = None
        self.last: Event | None = None
        self._slot = False
        self._closed = False
        self.outcome = "cancelled"
        # The router's span of this request ("router receive", ended by close()); None
        # when tracing is off (docs/architecture.md: Tracing).
        self.tracer: Tracer | None = tracer
        self.span: Span | None = span if tracer is not None else None

    async def start(self) -> None:
        """Queue, dispatch, first event. Raises ApiError (and closes itself) on failure."""
        try:
            await self._bounded(self.admission.acquire())
            self._slot = True
            self.opened = await self._bounded(self.dispatcher.open(
                self.ids, self.sampling, self.rid, extra=self.extra, span=self.span))
        except ApiError as exc:
            self.outcome = str(exc.code or exc.status)
            self.close()
            raise
        except BaseException:
            self.close()
            raise

    @property
    def headers(self) -> dict[str, str]:
        o = self.opened
        h = {"x-request-id": self.rid}
        if o is not None:
            h |= {"x-pdserve-prefill-node": o.prefill.node_id,
                  "x-pdserve-decode-node": o.decode.node_id}
        return h

    async def events(self) -> AsyncGenerator[Event | ApiError, None]:
        """Every decode event; a failure after the start comes as a final ApiError item
        (the caller has sent its 200 header by then and reports it in-band)."""
        assert self.opened is not None
        item: dict | str | ApiError = self.opened.first
        while True:
            try:
                while item != DONE:
                    assert isinstance(item, dict)  # an event; DONE is the only str
                    if self.opened.legs.prefill_answer is not None:
                        item = await self._with_prefill_logprobs(item)
                    event = to_event(self.rid, item, None if self.stitcher else self.last)
                    cut = False
                    if self.stitcher is not None:
                        raw_finish = event.finish_reason
                        event = self.stitcher.stitch(event)
                        cut = raw_finish is None and event.finish_reason is not None
                    self._observe(event)
                    self.last = event
                    yield event
                    if cut:
                        break  # a stop string across the migration point ends it here
                    item = await self._bounded(self.opened.legs.next())
                break
            except (LegError, StreamFormatError) as exc:
                item = await self._migrate(exc)
                if isinstance(item, ApiError):
                    yield item
                    return
            except ApiError as exc:  # the request timeout
                self.outcome = str(exc.code or exc.status)
                yield exc
                return
            except Exception as exc:  # a bug must still end the stream with a clear error
                self.outcome = "router_error"
                yield ApiError(502, f"the router failed relaying the decode stream: "
                                    f"{type(exc).__name__}: {exc}", "router_error")
                return
        if self.last is None:
            self.outcome = "empty"
            yield ApiError(503, f"decode node {self.opened.decode.node_id} ended the "
                                "stream without output")
            return
        self.outcome = self.last.finish_reason or "unknown"
        self._observe_end()

    async def _with_prefill_logprobs(self, obj: dict) -> dict:
        """The decode event with the prompt's and the first token's logprobs, which the
        prefill node computed (its answer trails the KV it sent only by a little)."""
        if self._prefill_meta is None:
            assert self.opened is not None and self.opened.legs.prefill_answer is not None
            self._prefill_meta = await self._bounded(
                asyncio.shield(self.opened.legs.prefill_answer))
        meta = obj.get("meta_info")
        if not isinstance(meta, dict):
            return obj
        return {**obj, "meta_info": merge_prefill(meta, self._prefill_meta)}

    async def _migrate(self, exc: LegError | StreamFormatError) -> dict | str | ApiError:
        """Continue on a new pair after the decode node died (the continuation's first
        event), or the error that ends the stream."""
        assert self.opened is not None
        err = exc.api_error() if isinstance(exc, LegError) else ApiError(503, str(exc))
        dead = self.opened.decode.node_id
        last, m = self.last, self.migration
        if last is not None and last.finish_reason is not None:
            return DONE  # everything reached the client; only the [DONE] was lost
        if not (is_decode_death(exc, dead) and last is not None and m.tokenizer is not None):
            self.outcome = str(err.code or err.status)
            return err
        if self.migrations >= m.limit:
            self.metrics.migrations.labels("limit").inc()
            self.outcome = str(err.code or err.status)
            return ApiError(err.status, f"{err.message} (not migrated: --migration-limit "
                                        f"{m.limit} reached)", err.code)
        self.migrations += 1
        self.opened.legs.cancel()
        self.dead_decodes.add(dead)  # never back to one it left (a stalled node may wake)
        ids, sampling = continuation(self.ids, self.sampling, last)
        # Logprobs: the new pair computes the continuation's output entries; the prompt's
        # entries the client has are kept (the continuation's "prompt" is not the client's).
        extra = {**self.extra, "logprob_start_len": -1} if self.extra else None
        began = time.time_ns() if self.span is not None else 0
        try:
            self.opened = await self._bounded(self.dispatcher.open(
                ids, sampling, f"{self.rid}-m{self.migrations}", exclude=self.dead_decodes,
                extra=extra, span=self.span))
        except ApiError as again:
            self._trace_migration(began, dead, "failed")
            self.metrics.migrations.labels("failed").inc()
            self.outcome = str(again.code or again.status)
            return ApiError(again.status, f"{err.message}; migrating the request failed: "
                                          f"{again.message}", again.code)
        self._trace_migration(began, dead, "ok")
        self.metrics.migrations.labels("ok").inc()
        self._prefill_meta = None  # the new prefill node's answer (first-token entry)
        stop = self.sampling.get("stop") or []
        self.stitcher = Stitcher(last, m.tokenizer, [stop] if isinstance(stop, str) else stop)
        return self.opened.first

    def _trace_migration(self, began: int, dead: str, outcome: str) -> None:
        """The span of one migration: from the decode node's death being handled to the
        new pair's first event (or the failure to find one)."""
        if self.tracer is not None and self.span is not None:
            self.tracer.child(self.span, "router migration", began, time.time_ns(),
                              dead_decode=dead, migration=self.migrations, outcome=outcome)

    async def _bounded(self, awaitable):
        remaining = self.deadline - time.perf_counter()
        if remaining <= 0:
            # asyncio.timeout fires only at a suspension; an awaitable that completes at
            # once (a leg queue with events waiting: a stream faster than its reader)
            # would let the request run past its deadline to the end.
            if inspect.iscoroutine(awaitable):
                awaitable.close()  # never started: closing it avoids "never awaited"
            raise self._timed_out()
        try:
            # Not wait_for: on Python 3.11 it drops a cancellation that lands as the
            # awaitable completes, and a flow whose client left would then read on.
            async with asyncio.timeout(max(remaining, 0.001)):
                return await awaitable
        except TimeoutError:
            raise self._timed_out() from None

    def _timed_out(self) -> ApiError:
        return ApiError(408, f"request timed out after {self.timeout_s:g}s", "timeout")

    def _observe(self, event: Event) -> None:
        if self.first_token_at is None and event.output_ids:
            self.first_token_at = time.perf_counter()
            self.metrics.ttft.observe(self.first_token_at - self.t0)

    def _observe_end(self) -> None:
        end = time.perf_counter()
        self.metrics.e2e.observe(end - self.t0)
        n = len(self.last.output_ids) if self.last else 0
        if self.first_token_at is not None and n > 1:
            self.metrics.tpot.observe((end - self.first_token_at) / (n - 1))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.opened is not None:
            self.opened.legs.cancel()
        if self._slot:
            self.admission.release()
        self.metrics.requests.labels(self.outcome).inc()
        if self.tracer is not None and self.span is not None:
            o = self.opened
            nodes = {"prefill": o.prefill.node_id, "decode": o.decode.node_id} if o else {}
            ok = self.outcome in ("stop", "length", "abort", "cancelled")
            self.tracer.end(self.span, None if ok else self.outcome, outcome=self.outcome,
                            rid=self.rid, migrations=self.migrations, **nodes)
