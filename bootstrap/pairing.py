"""Can KV move from one node's pool into another's? One rule over two registry records
(plain dicts), shared by the router (which pairs only compatible nodes) and the decode
node's front (which refuses a leg naming an incompatible prefill); docs/architecture.md:
Tensor parallelism, Router.

Same model, page size, transfer backend, layers, head size and dtype; and the same number
of model KV heads, which each node's TP size must split (divide them or be a multiple of
them), so that the prefill can slice its ranks' heads into the decode's ranks. A TP node's
`kv_layout.num_kv_heads` is its rank 0's share; `kv_heads_total` gives the model's count
(absent on a TP1 node, whose pool holds them all).
"""

from __future__ import annotations

from typing import Any

_SAME = ("model", "page_size", "transfer_backend")
_SAME_LAYOUT = ("num_layers", "head_dim", "dtype")


def tp_size(rec: dict[str, Any]) -> int:
    """Ranks of the node (`tp_size`, absent on TP1 nodes)."""
    return int(rec.get("tp_size") or 1)


def kv_heads_total(rec: dict[str, Any]) -> int:
    """The model's KV heads as the node reports them."""
    return int(rec.get("kv_heads_total") or (rec.get("kv_layout") or {}).get("num_kv_heads", 0))


def pairing_problem(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """Why KV cannot move between the nodes of records `a` and `b` (either direction), as
    "<field> <a's> != <b's>", or None when it can."""
    for name in _SAME:
        if a.get(name) != b.get(name):
            return f"{name} {a.get(name)!r} != {b.get(name)!r}"
    la, lb = a.get("kv_layout") or {}, b.get("kv_layout") or {}
    for name in _SAME_LAYOUT:
        if la.get(name) != lb.get(name):
            return f"kv_layout.{name} {la.get(name)!r} != {lb.get(name)!r}"
    ha, hb = kv_heads_total(a), kv_heads_total(b)
    if ha != hb:
        return f"KV heads {ha} != {hb} (KV cannot be sliced between different head counts)"
    for rec in (a, b):
        n = tp_size(rec)
        if ha < 1 or (ha % n and n % ha):
            return f"TP {n} cannot split {ha} KV heads (node {rec.get('node_id')!r})"
    if tp_size(a) == tp_size(b) and la.get("num_kv_heads") != lb.get("num_kv_heads"):
        return f"kv_layout.num_kv_heads {la.get('num_kv_heads')!r} != " \
               f"{lb.get('num_kv_heads')!r}"
    return None
