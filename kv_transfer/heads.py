"""KV moved between nodes of different TP sizes: which prefill rank writes which KV heads of
which decode rank, and the transfer entries of one such head run (docs/architecture.md:
Tensor parallelism, "P TP != D TP").

A rank's pool holds, per layer, K and V buffers of shape [slots, local Hkv, D] (token-major,
heads inner: the layout the attention reads). One token row of one layer is local Hkv * D
elements with heads contiguous, so a run of heads of one token is ONE contiguous byte range;
a run of heads of a page is `page_size` such ranges, one per token, strided by the token
row. Entries are generated vectorised (numpy), in (buffer, page, token) order on both sides,
so the same order gives the prefill's source and the decode's destination regions (and
their checksums).

Head ownership mirrors `pdserve/models/parallel.py: plan_tp` (kept torch-free here): with
Hkv >= N rank r owns Hkv/N heads from r*Hkv/N; with fewer KV heads than ranks each rank
holds the one head its q heads read (head r // (N/Hkv)), replicated on N/Hkv ranks. A
decode rank takes each of its heads from the prefill rank of its own index when that one
holds it (so equal TP sizes are rank to rank), else from the FIRST prefill rank holding it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kv_transfer.runs import Entries


def kv_heads_of(hkv: int, size: int, rank: int) -> tuple[int, int]:
    """(first model-global KV head, count) that rank `rank` of `size` holds."""
    if split_problem(hkv, size) is not None:
        raise ValueError(split_problem(hkv, size))
    if hkv >= size:
        return rank * (hkv // size), hkv // size
    return rank // (size // hkv), 1


def split_problem(hkv: int, size: int) -> str | None:
    """Why `size` ranks cannot hold `hkv` KV heads (plan_tp's rule), or None."""
    if hkv < 1 or size < 1:
        return f"invalid head split: {hkv} KV heads over TP {size}"
    if hkv % size and size % hkv:
        return f"TP {size} cannot split {hkv} KV heads (it must divide them or be a multiple)"
    return None


@dataclass(frozen=True)
class HeadRun:
    """Prefill rank `p_rank` of `p_size` writes `count` KV heads into decode rank `d_rank`
    of `d_size`: its local heads [src_head, src_head + count) go to the decode rank's local
    heads [dst_head, dst_head + count). src_heads / dst_heads: the local KV head count (token
    row) of each side's pool."""

    p_rank: int
    p_size: int
    d_rank: int
    d_size: int
    src_head: int
    dst_head: int
    count: int
    src_heads: int
    dst_heads: int

    @property
    def whole_rows(self) -> bool:
        """Both sides' whole token rows: a page is one contiguous range (page transfers)."""
        return self.count == self.src_heads == self.dst_heads


def head_runs(hkv: int, p_size: int, d_size: int) -> list[HeadRun]:
    """Every (prefill rank, decode rank) head run, decode rank order; raises ValueError
    when either TP size cannot split `hkv` heads."""
    for size in (p_size, d_size):
        if (why := split_problem(hkv, size)) is not None:
            raise ValueError(why)
    runs: list[HeadRun] = []
    for d in range(d_size):
        d0, dn = kv_heads_of(hkv, d_size, d)
        for h in range(d0, d0 + dn):
            p = _source_rank(hkv, p_size, d, h)
            p0, pn = kv_heads_of(hkv, p_size, p)
            last = runs[-1] if runs else None
            if last is not None and last.d_rank == d and last.p_rank == p:
                runs[-1] = HeadRun(p, p_size, d, d_size, last.src_head, last.dst_head,
                                   last.count + 1, pn, dn)
            else:
                runs.append(HeadRun(p, p_size, d, d_size, h - p0, h - d0, 1, pn, dn))
    return runs


def _source_rank(hkv: int, p_size: int, d_rank: int, head: int) -> int:
    """The prefill rank a decode rank takes `head` from: the rank of its own index when
    that one holds it (equal TP sizes: rank to rank, also with replicated heads), else
    the first rank holding it."""
    if d_rank < p_size and kv_heads_of(hkv, p_size, d_rank)[0] <= head < sum(
            kv_heads_of(hkv, p_size, d_rank)):
        return d_rank
    return head // (hkv // p_size) if hkv >= p_size else head * (p_size // hkv)


def sub_room(room: int, run: HeadRun) -> int:
    """The room id of one (prefill rank, decode rank) sub-transfer. Equal TP sizes keep the
    request's room (rank to rank: one sub-transfer per rank); otherwise a hash of the three,
    63 bits like the router's random rooms, computed identically on both nodes."""
    if run.p_size == run.d_size:
        return room
    digest = hashlib.blake2b(f"{room}/{run.p_rank}/{run.d_rank}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


def head_run_ptrs(bufs: Sequence[int], pages: Sequence[int], page_size: int, heads: int,
                  head0: int, head_bytes: int) -> np.ndarray:
    """Start pointer of the head run of every token of `pages` in every buffer, in
    (buffer, page, token) order; a token row is `heads * head_bytes`, the run starts at
    local head `head0`."""
    row = heads * head_bytes
    b = np.asarray(bufs, dtype=np.uint64)[:, None, None]
    p = np.asarray(pages, dtype=np.uint64)[None, :, None] * np.uint64(page_size * row)
    t = np.arange(page_size, dtype=np.uint64)[None, None, :] * np.uint64(row)
    return (b + p + t + np.uint64(head0 * head_bytes)).reshape(-1)


def head_run_regions(bufs: Sequence[int], pages: Sequence[int], page_size: int,
                     run: HeadRun, head_bytes: int, side: str) -> list[tuple[int, int]]:
    """(pointer, length) of every token's head run on one side ("src" or "dst")."""
    heads, head0 = (run.src_heads, run.src_head) if side == "src" else (run.dst_heads,
                                                                          run.dst_head)
    ptrs = head_run_ptrs(bufs, pages, page_size, heads, head0, head_bytes)
    n = run.count * head_bytes
    return [(p, n) for p in ptrs.tolist()]


def head_run_entries(src_bufs: Sequence[int], dst_bufs: Sequence[int], src: Sequence[int],
                     dst: Sequence[int], page_size: int, run: HeadRun, head_bytes: int,
                     out: Entries | None = None) -> Entries:
    """One entry per (layer buffer, token) of the pages: src page i goes to dst page i."""
    if len(src_bufs) != len(dst_bufs) or len(src) != len(dst):
        raise ValueError("source and destination buffers / pages differ in count")
    out = out if out is not None else Entries()
    s = head_run_ptrs(src_bufs, src, page_size, run.src_heads, run.src_head, head_bytes)
    d = head_run_ptrs(dst_bufs, dst, page_size, run.dst_heads, run.dst_head, head_bytes)
    out.src.extend(s.tolist())
    out.dst.extend(d.tolist())
    out.lens.extend([run.count * head_bytes] * len(s))
    return out
