"""Which nodes serve a request.

Prefill: prefix-aware, then load-aware. The first `--prefix-pages` full pages of the
prompt are hashed, and rendezvous (highest-random-weight) hashing maps that key onto one
of the live prefill nodes. Prompts that share those pages (one system prompt, one chat
history) so land on the node whose radix cache already holds them, and when a node joins
or leaves only the keys of that node move. Affinity yields to load when the preferred node
is clearly busier than the least-loaded one (both an absolute and a relative gap in the
router's open requests, as SGLang's cache-aware router does), so one hot prefix cannot
pile up on one node.

Decode: load-aware only (its cache is filled by the transfer, not by the prompt): the
least-loaded decode node whose KV pages and layout match the chosen prefill node; ties
break at random so idle nodes share the work.

Both return an ordered list: the first choice, then fallbacks for a retry.
"""

from __future__ import annotations

import hashlib
import random
from array import array

from pdserve.router.nodes import NodeState


def prefix_key(ids: list[int], page_size: int, pages: int) -> bytes | None:
    """Hash of the leading full pages (at most `pages`); None when there is none."""
    n = min(pages, len(ids) // page_size) * page_size
    if n <= 0:
        return None
    return hashlib.blake2b(array("q", ids[:n]).tobytes(), digest_size=16).digest()


def _weight(key: bytes, node_id: str) -> int:
    h = hashlib.blake2b(key + node_id.encode(), digest_size=8).digest()
    return int.from_bytes(h, "big")


def order_prefill(cands: list[NodeState], ids: list[int], prefix_pages: int,
                  abs_threshold: int, rel_threshold: float,
                  rng: random.Random) -> list[NodeState]:
    if not cands:
        return []
    by_load = sorted(cands, key=lambda n: (n.load(), rng.random()))
    page_size = min(n.record.page_size for n in cands)
    key = prefix_key(ids, page_size, prefix_pages)
    if key is None:
        return by_load
    preferred = max(cands, key=lambda n: _weight(key, n.node_id))
    least, mine = by_load[0].inflight, preferred.inflight
    if mine - least > abs_threshold and mine > least * rel_threshold:
        return by_load
    return [preferred, *(n for n in by_load if n is not preferred)]


def order_decode(cands: list[NodeState], prefill: NodeState,
                 rng: random.Random) -> list[NodeState]:
    matching = [n for n in cands if n.pairs_with(prefill)]
    return sorted(matching, key=lambda n: (*n.load(), n.record.load.kv_usage, rng.random()))
