"""The process pair the kv_transfer tests run against, and the fast test config."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kvt_harness import DECODE_PAGES, LAYOUT, META_ROWS, Node

BACKENDS = ["mooncake", "tcp"]
# Short timeouts so fault tests finish fast; heartbeat bound = 0.5 s * 4 = 2 s: no window
# under 2 s, so a loaded machine's late heartbeat does not kill a live peer.
FAST = {"heartbeat_interval_s": 0.5, "heartbeat_misses": 4, "bootstrap_timeout_s": 20.0,
        "transfer_timeout_s": 20.0, "tick_s": 0.02}
HEARTBEAT_BOUND_S = FAST["heartbeat_interval_s"] * FAST["heartbeat_misses"]


@dataclass
class Pair:
    backend: str
    prefill: Node
    decode: Node
    _next_page: int = 0
    _next_slot: int = 0
    _rng: random.Random = field(default_factory=lambda: random.Random(1234))
    _extra: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)

    def manager(self, node: Node, name: str, layout: dict[str, int] | None = None,
                dtype: str = "bfloat16", **cfg: Any) -> dict[str, Any]:
        """An extra manager (own pools, own config) inside one of the pair's processes;
        created once per session. Returns its endpoint/session."""
        key = (node.role, name)
        if key not in self._extra:
            self._extra[key] = node.call("add_manager", name, self.backend, {**FAST, **cfg},
                                         len(self._extra) + 10, layout or LAYOUT, dtype)
        return self._extra[key]

    def block(self, n: int) -> list[int]:
        """A fresh block of n decode pages no other test uses (decode pool starts zeroed)."""
        if self._next_page + n > DECODE_PAGES:
            raise RuntimeError("test decode pool exhausted; raise DECODE_PAGES")
        start, self._next_page = self._next_page, self._next_page + n
        return list(range(start, start + n))

    def room(self) -> int:
        return self._rng.getrandbits(63)

    def slot(self) -> int:
        """A metadata row index; cycles, so at most META_ROWS rooms may be live at once."""
        self._next_slot = (self._next_slot + 1) % META_ROWS
        return self._next_slot


def start_nodes(*specs: tuple[str, str, dict]) -> list[Node]:
    """Start several node processes at once (their torch imports overlap)."""
    nodes = [Node(role, backend, seed=i + 1, **cfg) for i, (role, backend, cfg) in
             enumerate(specs)]
    for n in nodes:
        n.ready()
    return nodes
