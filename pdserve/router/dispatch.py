"""Dispatch one request: pick a (prefill, decode) pair, draw a room, start both legs, and
wait for the decode leg's first event. A pair whose node could not be reached or refused
before doing anything is abandoned (both legs cancelled) and the next pair tried, up to
`--dispatch-attempts`, leaving out the nodes that failed; so is a pair whose prefill node
failed (itself, or as the decode node reports: KV lost), or whose decode node failed
(died, stalled, its scheduler gone), before the first token: nothing reached the client
yet. Any other failure (the client's, or a decode node's answer about the request) is
final. Once the first token is out, a dead decode node is the flow's to migrate.
"""

from __future__ import annotations

import logging
import random
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from bootstrap.pairing import pairing_problem
from pdserve.http.errors import ApiError
from pdserve.router.config import RouterConfig
from pdserve.router.legs import LegError, LegHook, Legs
from pdserve.router.nodes import NodeState, NodeTable
from pdserve.router.picker import order_decode, order_prefill
from pdserve.router.watcher import RegistryWatcher

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from pdserve.tracing.otel import Tracer

log = logging.getLogger("pdserve.router")


@dataclass
class Opened:
    legs: Legs
    first: dict | str  # the decode leg's first event (or DONE)

    @property
    def prefill(self) -> NodeState:
        return self.legs.prefill

    @property
    def decode(self) -> NodeState:
        return self.legs.decode


class Dispatcher:
    def __init__(self, cfg: RouterConfig, table: NodeTable, watcher: RegistryWatcher,
                 http: httpx.AsyncClient, on_leg: LegHook, on_retry,
                 tracer: Tracer | None = None) -> None:
        self.cfg, self.table, self.watcher, self.http = cfg, table, watcher, http
        self.tracer = tracer  # None: tracing off (docs/architecture.md: Tracing)
        self.on_leg, self.on_retry = on_leg, on_retry
        self.rng = random.Random()

    async def open(self, ids: list[int], sampling: dict, rid: str,
                   exclude: set[str] | frozenset[str] = frozenset(),
                   extra: dict | None = None, span: Span | None = None) -> Opened:
        """`exclude`: nodes to avoid while another is usable (a migration's dead node).
        `extra`: more /generate fields for both legs (SGLang's logprob fields). `span`: the
        request's trace span (None: untraced); both legs carry its `traceparent`."""
        excluded: set[str] = set(exclude)
        last: LegError | None = None
        tracer = self.tracer if span is not None else None
        headers = tracer.headers(span) if tracer is not None and span is not None else None
        for attempt in range(self.cfg.dispatch_attempts):
            picked_at = time.time_ns() if tracer is not None else 0
            prefill, decode = await self.pick(ids, excluded, last)
            if tracer is not None and span is not None:
                tracer.child(span, "router pick", picked_at, time.time_ns(), attempt=attempt,
                             prefill=prefill.node_id, decode=decode.node_id)
            body = {"input_ids": ids, "sampling_params": sampling,
                    "rid": f"{rid}-{attempt}", "bootstrap_room": secrets.randbits(63),
                    **(extra or {})}
            legs = Legs(self.http, prefill, decode, body, self.on_leg,
                        self.cfg.stream_stall_timeout_s, headers)
            legs.start()
            try:
                return Opened(legs, await legs.next())
            except LegError as err:
                legs.cancel()
                # Nothing reached the client yet, so a node's own failure (a prefill node
                # that failed, a decode node that died or stalled before its first token)
                # can be retried on another pair: at worst a prompt is computed twice. A
                # sampled request draws afresh there, which no client can tell apart.
                if not (err.retryable or (err.node_fault and (err.node is prefill or
                                                            err.node is decode))):
                    raise err.api_error() from None
                log.warning("attempt %d of %s: %s; trying another pair", attempt + 1, rid,
                            err.message)
                excluded.add(err.node.node_id)
                last = err
                self.on_retry()
            except BaseException:  # cancelled (client gone, timeout): stop both legs
                legs.cancel()
                raise
        assert last is not None
        raise ApiError(last.status, f"no node pair could take the request after "
                                    f"{self.cfg.dispatch_attempts} attempts; last: {last.message}")

    async def pick(self, ids: list[int], excluded: set[str],
                   last: LegError | None) -> tuple[NodeState, NodeState]:
        for early_read in (False, True):
            if early_read:  # nothing usable: maybe a node registered since the last read
                await self.watcher.refresh_soon()
            pair = self._choose(ids, excluded)
            if pair is not None:
                pair[0].breaker.acquire()
                pair[1].breaker.acquire()
                return pair
        raise ApiError(503, self._why_none(last), "no_node")

    def _choose(self, ids: list[int], excluded: set[str]) -> tuple[NodeState, NodeState] | None:
        c = self.cfg
        prefills = _prefer_others(self.table.usable("prefill"), excluded)
        decodes = _prefer_others(self.table.usable("decode"), excluded)
        for p in order_prefill(prefills, ids, c.prefix_pages, c.balance_abs_threshold,
                               c.balance_rel_threshold, self.rng):
            ranked = order_decode(decodes, p, self.rng)
            if ranked:
                return p, ranked[0]
        return None

    def _why_none(self, last: LegError | None) -> str:
        parts = []
        for role in ("prefill", "decode"):
            nodes = self.table.of_role(role)
            if not nodes:
                parts.append(f"no {role} node is registered")
            elif not [n for n in nodes if n.breaker.available()]:
                errors = "; ".join(f"{n.node_id}: {n.last_error or n.breaker.state}"
                                   for n in nodes[:4])
                parts.append(f"every {role} node is failing ({errors})")
        if not parts:
            parts.append("no decode node can take a prefill node's KV" + self._pair_example())
        if last is not None:
            parts.append(f"last error: {last.message}")
        if self.watcher.last_error:
            parts.append(f"registry unreachable: {self.watcher.last_error}")
        return "no node can serve the request: " + "; ".join(parts)


    def _pair_example(self) -> str:
        """Why the first prefill / decode nodes do not pair (bootstrap/pairing.py)."""
        ps, ds = self.table.of_role("prefill"), self.table.of_role("decode")
        if not ps or not ds:
            return ""
        p, d = ps[0], ds[0]
        why = pairing_problem(p.as_dict(), d.as_dict())
        return f" (e.g. {p.node_id} -> {d.node_id}: {why})" if why else ""


def _prefer_others(nodes: list[NodeState], excluded: set[str]) -> list[NodeState]:
    """Nodes that failed this request are left out while another is usable; a lone node
    whose breaker still allows it (the failure was soft, e.g. a slow accept) is retried."""
    others = [n for n in nodes if n.node_id not in excluded]
    return others or nodes
