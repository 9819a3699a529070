"""KV sliced by heads between TP sizes (kv_transfer/heads.py), without a model: which
prefill rank writes which heads of which decode rank, and the byte ranges of its entries,
applied with memmove to real buffers."""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import pytest

from kv_transfer.heads import (
    head_run_entries,
    head_run_regions,
    head_runs,
    kv_heads_of,
    sub_room,
)


def _table(hkv: int, p: int, d: int) -> list[tuple]:
    """(p_rank, d_rank, src_head, dst_head, count, src_heads, dst_heads) of every run."""
    return [(r.p_rank, r.d_rank, r.src_head, r.dst_head, r.count, r.src_heads, r.dst_heads)
            for r in head_runs(hkv, p, d)]


def test_head_runs_map_every_decode_head_to_a_prefill_rank_holding_it():
    # P TP1 -> D TP2: rank 0 holds both heads; decode rank d gets head d.
    assert _table(2, 1, 2) == [(0, 0, 0, 0, 1, 2, 1), (0, 1, 1, 0, 1, 2, 1)]
    # P TP2 -> D TP1: decode rank 0 takes head 0 from prefill rank 0, head 1 from rank 1.
    assert _table(2, 2, 1) == [(0, 0, 0, 0, 1, 1, 2), (1, 0, 0, 1, 1, 1, 2)]
    # Equal sizes: rank to rank, whole token rows.
    runs = head_runs(2, 2, 2)
    assert _table(2, 2, 2) == [(0, 0, 0, 0, 1, 1, 1), (1, 1, 0, 0, 1, 1, 1)]
    assert all(r.whole_rows for r in runs)
    # Several heads per rank move as one run of heads per token row.
    assert _table(8, 2, 4) == [(0, 0, 0, 0, 2, 4, 2), (0, 1, 2, 0, 2, 4, 2),
                               (1, 2, 0, 0, 2, 4, 2), (1, 3, 2, 0, 2, 4, 2)]
    assert _table(8, 4, 2) == [(0, 0, 0, 0, 2, 2, 4), (1, 0, 0, 2, 2, 2, 4),
                               (2, 1, 0, 0, 2, 2, 4), (3, 1, 0, 2, 2, 2, 4)]


def test_replicated_kv_heads_come_from_the_same_index_or_the_first_rank_holding_them():
    # GQA, 1 KV head: every rank of either node holds it.
    assert _table(1, 2, 1) == [(0, 0, 0, 0, 1, 1, 1)]  # prefill rank 1 writes nothing
    assert _table(1, 1, 2) == [(0, 0, 0, 0, 1, 1, 1), (0, 1, 0, 0, 1, 1, 1)]
    assert _table(1, 2, 2) == [(0, 0, 0, 0, 1, 1, 1), (1, 1, 0, 0, 1, 1, 1)]  # rank to rank
    assert _table(1, 4, 2) == [(0, 0, 0, 0, 1, 1, 1), (1, 1, 0, 0, 1, 1, 1)]
    # 2 KV heads over TP4 prefill: ranks 0,1 hold head 0 and ranks 2,3 head 1.
    assert [kv_heads_of(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert _table(2, 4, 1) == [(0, 0, 0, 0, 1, 1, 2), (2, 0, 0, 1, 1, 1, 2)]
    assert _table(2, 4, 2) == [(0, 0, 0, 0, 1, 1, 1), (2, 1, 0, 0, 1, 1, 1)]


def test_a_tp_size_that_cannot_split_the_heads_is_refused():
    with pytest.raises(ValueError, match="TP 3 cannot split 2 KV heads"):
        head_runs(2, 3, 1)
    with pytest.raises(ValueError, match="TP 3 cannot split 8 KV heads"):
        head_runs(8, 2, 3)


def test_sub_rooms_keep_the_room_for_equal_sizes_and_differ_per_pair_otherwise():
    room = 123456789
    assert {sub_room(room, r) for r in head_runs(2, 2, 2)} == {room}
    assert {sub_room(room, r) for r in head_runs(1, 2, 2)} == {room}  # each rank: one room
    subs = [sub_room(room, r) for r in head_runs(8, 2, 4)]
    assert len(set(subs)) == 4 and all(0 <= s < 1 << 63 for s in subs)
    assert subs == [sub_room(room, r) for r in head_runs(8, 2, 4)]  # same on both nodes
    assert subs != [sub_room(room + 1, r) for r in head_runs(8, 2, 4)]


@pytest.mark.parametrize("hkv,p_size,d_size", [(2, 1, 2), (2, 2, 1), (8, 2, 4), (8, 4, 2),
                                                (1, 2, 1), (2, 4, 1), (1, 4, 2)])
def test_entries_move_exactly_the_decode_ranks_heads(hkv, p_size, d_size):
    """Pools as the engine lays them out ([slots, local Hkv, D] per layer buffer, K then V);
    applying every run's entries fills each decode rank's pages with its heads of the
    prefill's pages, and nothing else."""
    bufs, page_size, num_pages, dim = 3, 4, 8, 5
    rng = np.random.default_rng(0)
    full = rng.standard_normal((bufs, num_pages * page_size, hkv, dim)).astype(np.float32)

    def pools(size: int, data: bool) -> list[list[np.ndarray]]:
        out = []
        for rank in range(size):
            h0, n = kv_heads_of(hkv, size, rank)
            out.append([np.ascontiguousarray(full[b, :, h0:h0 + n]) if data
                        else np.zeros((num_pages * page_size, n, dim), np.float32)
                        for b in range(bufs)])
        return out

    src_pools, dst_pools = pools(p_size, True), pools(d_size, False)
    src_pages, dst_pages = [3, 4, 7], [0, 5, 2]
    head_bytes = dim * 4
    for run in head_runs(hkv, p_size, d_size):
        src_bufs = [a.ctypes.data for a in src_pools[run.p_rank]]
        dst_bufs = [a.ctypes.data for a in dst_pools[run.d_rank]]
        e = head_run_entries(src_bufs, dst_bufs, src_pages, dst_pages, page_size, run,
                             head_bytes)
        assert len(e) == bufs * len(src_pages) * page_size
        assert set(e.lens) == {run.count * head_bytes}
        for s, d, n in zip(e.src, e.dst, e.lens, strict=True):
            ctypes.memmove(d, s, n)
        # Source and destination regions list the same bytes in the same order (the
        # checksum of a sliced transfer is computed over them on each side).
        src_crc = zlib.crc32(b"".join(ctypes.string_at(p, n) for p, n in head_run_regions(
            src_bufs, src_pages, page_size, run, head_bytes, "src")))
        dst_crc = zlib.crc32(b"".join(ctypes.string_at(p, n) for p, n in head_run_regions(
            dst_bufs, dst_pages, page_size, run, head_bytes, "dst")))
        assert src_crc == dst_crc
    for rank in range(d_size):
        h0, n = kv_heads_of(hkv, d_size, rank)
        for b in range(bufs):
            got = dst_pools[rank][b].reshape(num_pages, page_size, n, dim)
            want = full[b, :, h0:h0 + n].reshape(num_pages, page_size, n, dim)
            for s, d in zip(src_pages, dst_pages, strict=True):
                assert np.array_equal(got[d], want[s]), (rank, b, s, d)
            untouched = [p for p in range(num_pages) if p not in dst_pages]
            assert not got[untouched].any()


def test_every_split_covers_each_decode_head_once_with_distinct_sub_rooms():
    """Over every valid pair of TP sizes: each decode rank gets each of its heads exactly
    once, from a prefill rank holding it, and no manager sees one sub-room id twice."""
    for hkv in (1, 2, 4, 8):
        sizes = [n for n in (1, 2, 4, 8, 16) if hkv % n == 0 or n % hkv == 0]
        for p in sizes:
            for d in sizes:
                runs = head_runs(hkv, p, d)
                for rank in range(d):
                    d0, dn = kv_heads_of(hkv, d, rank)
                    got = []
                    for r in (r for r in runs if r.d_rank == rank):
                        p0, _ = kv_heads_of(hkv, p, r.p_rank)
                        got += [p0 + r.src_head + i for i in range(r.count)]
                        assert r.dst_head + r.count <= dn and r.src_head + r.count <= r.src_heads
                    assert sorted(got) == list(range(d0, d0 + dn)), (hkv, p, d, rank)
                for side in ("p_rank", "d_rank"):
                    for rank in range(max(p, d)):
                        ids = [sub_room(7, r) for r in runs if getattr(r, side) == rank]
                        assert len(ids) == len(set(ids)), (hkv, p, d, side, rank)


class _Times:
    """A sub-sender's / sub-receiver's trace times (all SubRooms reads of them here)."""

    def __init__(self, accepted_at=None, jobs_done_at=(), finished_at=None) -> None:
        self.accepted_at, self.finished_at = accepted_at, finished_at
        self.jobs_done_at = list(jobs_done_at)


def test_sub_rooms_report_trace_times_once_every_share_has_them():
    """A TP room's trace times (prefill bootstrap end, each KV send's end, the decode's
    receive end) are those of its last share; none until every share has one."""
    from pdserve.pd.sub_rooms import SubRooms

    senders = SubRooms([_Times(1.0, [2.0, 5.0]), _Times(None, [3.0])], decode=False)
    assert senders.accepted_at is None  # one decode rank has not asked yet
    assert senders.jobs_done_at == [3.0]  # the second send is not written everywhere
    senders.handles[1].accepted_at = 1.5
    senders.handles[1].jobs_done_at.append(4.0)
    assert senders.accepted_at == 1.5 and senders.jobs_done_at == [3.0, 5.0]
    receivers = SubRooms([_Times(finished_at=7.0), _Times()], decode=True)
    assert receivers.finished_at is None
    receivers.handles[1].finished_at = 6.0
    assert receivers.finished_at == 7.0
    assert SubRooms([], decode=True).finished_at is None  # nothing to receive
