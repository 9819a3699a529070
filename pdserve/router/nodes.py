"""The router's view of the cluster: the registry's live records plus what the router
itself knows about each node (requests it has in flight there, its circuit breaker).

The table is replaced wholesale on every registry read, so a node that registers is used
on the next read and one whose record is gone (deregistered or expired) is dropped. A
node that restarted (same node_id, new instance_id) starts with a fresh breaker.
Requests keep a reference to the `NodeState` they were sent to, so dropping a node from
the table never disturbs a request in flight there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from bootstrap.pairing import pairing_problem
from bootstrap.record import RegisteredNode
from pdserve.router.breaker import CircuitBreaker
from pdserve.router.config import RouterConfig

log = logging.getLogger("pdserve.router")


@dataclass(eq=False)
class NodeState:
    record: RegisteredNode
    breaker: CircuitBreaker
    inflight: int = 0  # this router's open legs on the node
    draining: bool = False  # it answered 503 "draining": never picked again (this instance)
    last_error: str = ""
    counts: dict[str, int] = field(default_factory=dict)  # outcome -> legs
    # Kept although the registry no longer lists it, until then (time.monotonic()): the
    # registry forgot it (new store epoch), and its heartbeat will bring it back.
    carried_until: float | None = None
    _dict: dict = field(default_factory=dict, repr=False, compare=False)
    _dict_of: RegisteredNode | None = field(default=None, repr=False, compare=False)

    @property
    def node_id(self) -> str:
        return self.record.node_id

    @property
    def role(self) -> str:
        return self.record.role

    @property
    def url(self) -> str:
        return self.record.http_url.rstrip("/")

    def load(self) -> tuple[int, int]:
        """Sort key of how busy the node is: first this router's open legs there (exact,
        and current to the request), then what the node last reported (running + waiting:
        it also counts other routers' traffic, but lags by up to a heartbeat, and a stale
        peak must not starve a node that has long drained)."""
        return self.inflight, self.reported()

    def reported(self) -> int:
        return self.record.load.running + self.record.load.waiting

    def pairs_with(self, other: NodeState) -> bool:
        """Can KV move between the two? Same pages, layout, transfer backend and model KV
        heads, which both TP sizes split (bootstrap/pairing.py; docs/architecture.md: Tensor
        parallelism): KV is sliced by heads between different TP sizes."""
        return pairing_problem(self.as_dict(), other.as_dict()) is None

    def as_dict(self) -> dict:
        """The record as JSON (extra fields included), computed once per record."""
        if self._dict_of is not self.record:
            self._dict, self._dict_of = self.record.model_dump(mode="json"), self.record
        return self._dict

    def view(self) -> dict:
        r = self.record
        return {"node_id": r.node_id, "role": r.role, "http_url": r.http_url,
                "instance_id": r.instance_id, "model": r.model, "page_size": r.page_size,
                "load": r.load.model_dump(), "inflight": self.inflight,
                "breaker": self.breaker.state, "draining": self.draining,
                "last_error": self.last_error,
                "legs": dict(self.counts)}


def tp_size(record) -> int:
    """`tp_size` of a record (an extra field, absent on TP1 nodes)."""
    return (record.model_extra or {}).get("tp_size", 1)


class NodeTable:
    def __init__(self, cfg: RouterConfig, model: str = "") -> None:
        self.cfg = cfg
        self.model = model  # "" until adopted from the first record
        self.nodes: dict[str, NodeState] = {}
        self.epoch = ""  # the registry store's epoch of the last read
        self._ignored: set[str] = set()  # node ids already warned about

    def new_breaker(self) -> CircuitBreaker:
        c = self.cfg
        return CircuitBreaker(c.breaker_failures, c.breaker_cooldown_s, c.breaker_max_cooldown_s)

    def update(self, records: list[RegisteredNode], epoch: str = "") -> None:
        """The table from one registry read. A node missing from it is dropped, unless
        the store's epoch changed (the registry restarted empty, or its Redis did): then
        the node is carried for as long as its record would have lived (its ttl_s), since
        its next heartbeat brings it back; a node that really left is gone by then."""
        carried = self._carry(records, epoch)
        self._replace(records)
        self.nodes.update(carried)

    def _carry(self, records: list[RegisteredNode], epoch: str) -> dict[str, NodeState]:
        now, listed = time.monotonic(), {r.node_id for r in records}
        forgot = bool(epoch and self.epoch and epoch != self.epoch)
        self.epoch = epoch or self.epoch
        carried = {}
        for node_id, n in self.nodes.items():
            if node_id in listed:
                continue
            if forgot and n.carried_until is None:
                n.carried_until = now + n.record.ttl_s
                log.info("registry restarted empty; keeping node %s for %.0fs until it "
                         "re-registers", node_id, n.record.ttl_s)
            if n.carried_until is not None and now < n.carried_until:
                carried[node_id] = n
        return carried

    def _replace(self, records: list[RegisteredNode]) -> None:
        if not self.model and records:
            self.model = records[0].model
            log.info("serving model %r (from node %s)", self.model, records[0].node_id)
        fresh: dict[str, NodeState] = {}
        for rec in records:
            if rec.model != self.model:
                if rec.node_id not in self._ignored:
                    self._ignored.add(rec.node_id)
                    log.warning("ignoring node %s: it serves %r, this router %r",
                                rec.node_id, rec.model, self.model)
                continue
            old = self.nodes.get(rec.node_id)
            if old is not None and old.record.instance_id == rec.instance_id:
                old.record, old.carried_until = rec, None
                fresh[rec.node_id] = old
            else:
                log.info("%s %s node %s at %s", "restarted" if old else "new", rec.role,
                         rec.node_id, rec.http_url)
                fresh[rec.node_id] = NodeState(rec, self.new_breaker())
        for gone in self.nodes.keys() - fresh.keys():
            if self.nodes[gone].carried_until is None:
                log.info("node %s left the registry", gone)
        self.nodes = fresh

    def of_role(self, role: str) -> list[NodeState]:
        return [n for n in self.nodes.values() if n.role == role]

    def usable(self, role: str) -> list[NodeState]:
        return [n for n in self.of_role(role) if not n.draining and n.breaker.available()]

    def counts(self) -> dict[str, int]:
        return {role: len(self.of_role(role)) for role in ("prefill", "decode")}
