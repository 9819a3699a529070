"""Everything one router process holds: the node table and its registry watcher, the
bounded queue, the HTTP client towards nodes, the dispatcher, metrics and the tokenizer
(loaded at start when `--model` is given, else once the first node tells the model).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import httpx

from pdserve.http.errors import ApiError
from pdserve.router.admission import Admission
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.router.flow import Flow, Migration
from pdserve.router.metrics import RouterMetrics
from pdserve.router.nodes import NodeState, NodeTable
from pdserve.router.tokenizer import RouterTokenizer
from pdserve.router.transport import NodeTransport
from pdserve.router.watcher import RegistryWatcher
from pdserve.tracing import make_tracer

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger("pdserve.router")


class Gateway:
    def __init__(self, cfg: RouterConfig, tokenizer: RouterTokenizer | None = None) -> None:
        self.cfg = cfg
        self.table = NodeTable(cfg, model=cfg.model)
        self.watcher = RegistryWatcher(cfg, self.table, self._load_tokenizer_soon)
        self.admission = Admission(cfg.max_running_requests, cfg.max_queued_requests,
                                   cfg.queue_timeout_s)
        self.metrics = RouterMetrics()
        self.metrics.watch(lambda: self.table, self.admission, self.watcher.outage_s)
        # read=None: a decode leg streams for as long as generation lasts; the request
        # timeout bounds it instead. No proxy from the environment between router and nodes.
        # The transport keeps connections to nodes alive across requests (transport.py).
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=cfg.connect_timeout_s),
            transport=NodeTransport(), trust_env=False)
        # None unless --otlp-traces-endpoint: then no OpenTelemetry module is loaded at all.
        self.tracer = make_tracer(cfg.otlp_traces_endpoint, "pdserve-router")
        self.dispatcher = Dispatcher(cfg, self.table, self.watcher, self.http, self._on_leg,
                                     self.metrics.retries.inc, self.tracer)
        self._tokenizer = tokenizer
        self._tokenizer_task: asyncio.Future | None = None
        self._warm_task: asyncio.Future | None = None
        self._watch_task: asyncio.Task | None = None

    @property
    def model_name(self) -> str:
        return self.cfg.served_model_name or self.table.model

    async def start(self) -> None:
        await self.watcher.refresh()
        self._watch_task = asyncio.create_task(self.watcher.run())

    async def close(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        await self.http.aclose()
        await asyncio.to_thread(self.watcher.close)
        if self.tracer is not None:  # the spans still queued go out now
            await asyncio.to_thread(self.tracer.shutdown)

    @property
    def loaded_tokenizer(self) -> RouterTokenizer | None:
        """The tokenizer once loaded (None before the first request needed it)."""
        return self._tokenizer

    async def tokenizer(self) -> RouterTokenizer:
        if self._tokenizer is not None:
            return self._tokenizer
        if not self.table.model:
            raise ApiError(503, "no node has registered yet (the router learns the model "
                                "from the first node); try again shortly", "no_node")
        if self._tokenizer_task is None:
            self._tokenizer_task = asyncio.ensure_future(asyncio.to_thread(
                RouterTokenizer, self.table.model, self.cfg.model_cache_dir,
                self.cfg.chat_template, self.cfg.revision))
        try:
            self._tokenizer = await asyncio.shield(self._tokenizer_task)
        except Exception as exc:  # any loader failure: the model's files are unusable
            raise ApiError(503, f"cannot load the tokenizer of {self.table.model!r}: {exc}",
                           "no_tokenizer") from exc
        assert self._tokenizer is not None
        return self._tokenizer

    def flow(self, rid: str, ids: list[int], sampling: dict, extra: dict | None = None,
             trace: tuple[Mapping[str, str], int] | None = None) -> Flow:
        """`trace`: the client request's headers and arrival time (`time.time_ns()`), for
        its "router receive" span (ignored when tracing is off)."""
        tok = self._tokenizer.tok if self._tokenizer is not None else None
        span = self.receive_span(rid, *trace) if trace is not None else None
        return Flow(rid, ids, sampling, self.admission, self.dispatcher, self.metrics,
                    self.cfg.request_timeout_s, Migration(self.cfg.migration_limit, tok),
                    extra, self.tracer, span)

    def receive_span(self, rid: str, headers: Mapping[str, str], received_ns: int
                     ) -> Span | None:
        """The router's span of one request, a child of the client's `traceparent` when
        it sent one; None when tracing is off."""
        if self.tracer is None:
            return None
        return self.tracer.server_span("router receive", headers, received_ns, rid=rid)

    def _on_leg(self, node: NodeState, outcome: str) -> None:
        node.counts[outcome] = node.counts.get(outcome, 0) + 1
        self.metrics.legs.labels(node.node_id, node.role, outcome).inc()

    def health(self) -> tuple[bool, dict]:
        """Ready to serve: the tokenizer is loaded and some usable prefill node has a
        usable decode node it pairs with."""
        prefill, decode = self.table.usable("prefill"), self.table.usable("decode")
        paired = any(p.pairs_with(d) for p in prefill for d in decode)
        info = {"model": self.model_name, "prefill": len(prefill), "decode": len(decode),
                "registry": "ok" if self.watcher.connected else self.watcher.last_error}
        if self._tokenizer is None:
            return False, {**info, "reason": "the tokenizer is not loaded yet"}
        if not paired:
            return False, {**info, "reason": "no usable prefill/decode pair"}
        return True, info

    def _load_tokenizer_soon(self) -> None:
        """Once the model is known (from the first node), load its tokenizer in the
        background rather than on the first request."""
        if self.table.model and self._tokenizer is None and self._warm_task is None:
            self._warm_task = asyncio.ensure_future(self._warm_tokenizer())

    async def _warm_tokenizer(self) -> None:
        try:
            await self.tokenizer()
        except ApiError as exc:
            log.error("%s", exc.message)
