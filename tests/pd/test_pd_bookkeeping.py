"""Prefill send bookkeeping and the metadata slot, without a model (docs/architecture.md: PD
bookkeeping, KV transfer):
`tmp_end_idx` across chunks and page boundaries, two chunks of one request in flight,
results out of order, `inflight_middle_chunks` deciding the final chunk and under abort,
early-send ranges (with the host-tier `loading_pages` exclusion), metadata rows."""

from __future__ import annotations

import struct

import pytest

from pdserve.pd.metadata import ROW_BYTES, MetadataPool, pack_row, unpack_row
from prefill_node.bookkeeping import SendProgress


def run_chunks(prog: SendProgress, ends: list[int], overlap: bool) -> list[range]:
    """Schedule and process chunks ending at `ends` (the last is the last chunk) the way the
    normal loop (schedule, process) or the overlap loop (schedule N+1, then process N) does.
    Returns the page ranges sent, in order; checks the final chunk is recognised."""
    sent: list[range] = []
    pending: list[int] = []

    def process() -> None:
        e = pending.pop(0)
        pages, last = prog.chunk_done(aborted=False, row_end=e)
        assert last == (e == ends[-1])
        sent.append(pages)

    for end in ends:
        prog.chunk_scheduled(end)
        assert prog.tmp_end_idx == end  # recorded at scheduling time
        pending.append(end)
        if not overlap or len(pending) > 1:
            process()
    while pending:
        process()
    return sent


def flat(ranges: list[range]) -> list[int]:
    return [p for r in ranges for p in r]


# -- tmp_end_idx and page boundaries -------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_chunks_send_whole_pages_then_partial_last_page(overlap):
    prog = SendProgress(prompt_len=100, page_size=16)  # 7 pages, the last holds 4 tokens
    assert prog.total_pages == 7
    sent = run_chunks(prog, [40, 80, 100], overlap)
    # 40 tokens complete pages 0-1 (page 2 is half-written and waits), 80 complete 2-4,
    # the last chunk sends the rest including the partial page 6.
    assert sent == [range(0, 2), range(2, 5), range(5, 7)]
    assert prog.sent_pages == 7 and prog.inflight_middle_chunks == 0
    assert prog.tmp_end_idx == 100 and prog.inflight_chunks == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_chunk_ends_on_page_boundaries(overlap):
    prog = SendProgress(prompt_len=128, page_size=16)
    sent = run_chunks(prog, [64, 128], overlap)
    assert sent == [range(0, 4), range(4, 8)]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_chunk_smaller_than_a_page_sends_nothing_until_a_page_completes(overlap):
    prog = SendProgress(prompt_len=40, page_size=16)
    sent = run_chunks(prog, [5, 10, 15, 20, 33, 40], overlap)
    assert sent == [range(0), range(0), range(0), range(0, 1), range(1, 2), range(2, 3)]
    assert flat(sent) == [0, 1, 2]


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
@pytest.mark.parametrize("prompt_len", [1, 15, 16, 17, 64, 65, 150])
@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_every_page_sent_exactly_once_in_order(page_size, prompt_len, chunk, overlap):
    prog = SendProgress(prompt_len, page_size)
    ends = list(range(chunk, prompt_len, chunk)) + [prompt_len]
    sent = run_chunks(prog, ends, overlap)
    assert flat(sent) == list(range(-(-prompt_len // page_size)))
    for end, r in zip(ends[:-1], sent, strict=False):  # a middle chunk: only valid pages
        assert r.stop * page_size <= end
    assert prog.inflight_middle_chunks == 0


def test_page_size_one_sends_every_token_of_a_chunk():
    prog = SendProgress(prompt_len=10, page_size=1)
    assert run_chunks(prog, [4, 7, 10], overlap=True) == [range(0, 4), range(4, 7),
                                                           range(7, 10)]


def test_two_chunks_in_flight_each_result_sends_what_its_own_forward_completed():
    prog = SendProgress(prompt_len=200, page_size=16)
    prog.chunk_scheduled(64)
    prog.chunk_scheduled(128)  # overlap: launched before 64's result was processed
    assert prog.tmp_end_idx == 128 and prog.inflight_middle_chunks == 2
    # 64's result: only its pages, although tmp_end_idx already says 128
    assert prog.chunk_done(aborted=False) == (range(0, 4), False)
    assert prog.tmp_end_idx == 128 and prog.inflight_middle_chunks == 1
    prog.chunk_scheduled(200)  # the last chunk, launched before 128's result
    assert prog.inflight_middle_chunks == 1 and prog.inflight_chunks == 2
    assert prog.chunk_done(aborted=False, row_end=128) == (range(4, 8), False)
    assert prog.inflight_middle_chunks == 0
    # the counter is 0: this result is the final chunk
    assert prog.chunk_done(aborted=False, row_end=200) == (range(8, 13), True)
    assert prog.inflight_chunks == 0


def test_result_fed_out_of_order_raises_and_sends_nothing():
    prog = SendProgress(prompt_len=200, page_size=16)
    prog.chunk_scheduled(64)
    prog.chunk_scheduled(128)
    with pytest.raises(RuntimeError, match="out of order"):
        prog.chunk_done(aborted=False, row_end=128)  # 64's result has not been processed
    assert prog.sent_pages == 0 and prog.inflight_middle_chunks == 2
    assert prog.chunk_done(aborted=False, row_end=64).pages == range(0, 4)


def test_result_without_a_launched_chunk_raises():
    prog = SendProgress(prompt_len=100, page_size=16)
    with pytest.raises(RuntimeError, match="no launched chunk"):
        prog.chunk_done(aborted=False)
    prog.chunk_scheduled(100)
    prog.chunk_done(aborted=False)
    with pytest.raises(RuntimeError, match="no launched chunk"):
        prog.chunk_done(aborted=True)
    assert prog.inflight_middle_chunks == 0


@pytest.mark.parametrize("ends", [[64, 64], [64, 32], [0], [101], [100, 120]])
def test_scheduling_a_chunk_that_does_not_advance_raises(ends):
    prog = SendProgress(prompt_len=100, page_size=16)
    with pytest.raises(RuntimeError):
        for end in ends:
            prog.chunk_scheduled(end)


def test_early_sent_prefix_then_chunks_continue_after_it():
    prog = SendProgress(prompt_len=100, page_size=16)
    assert prog.early_send(48) == range(0, 3)  # 3 cached pages go out before the forward
    sent = run_chunks(prog, [80, 100], overlap=True)
    assert sent == [range(3, 5), range(5, 7)]


# -- inflight_middle_chunks under abort -------------------------------------------------------


def test_abort_drops_in_flight_middle_chunks_and_counter_reaches_zero():
    prog = SendProgress(prompt_len=300, page_size=16)
    prog.chunk_scheduled(64)
    assert prog.chunk_done(aborted=False).pages == range(0, 4)
    prog.chunk_scheduled(128)
    prog.chunk_scheduled(192)  # two launched, unprocessed
    assert prog.inflight_middle_chunks == 2
    # abort: their results arrive later and are dropped, nothing more is sent
    assert prog.chunk_done(aborted=True, row_end=128) == (range(0), False)
    assert prog.inflight_middle_chunks == 1
    assert prog.chunk_done(aborted=True, row_end=192) == (range(0), False)
    assert prog.inflight_middle_chunks == 0 and prog.inflight_chunks == 0
    assert prog.sent_pages == 4


def test_last_chunk_does_not_touch_the_counter():
    prog = SendProgress(prompt_len=20, page_size=16)
    prog.chunk_scheduled(20)
    assert prog.inflight_middle_chunks == 0
    assert prog.chunk_done(aborted=False) == (range(0, 2), True)
    assert prog.inflight_middle_chunks == 0


def test_no_chunk_after_the_last_chunk():
    prog = SendProgress(prompt_len=20, page_size=16)
    prog.chunk_scheduled(20)
    with pytest.raises(RuntimeError):
        prog.chunk_scheduled(20)


def test_aborted_last_chunk_sends_nothing():
    prog = SendProgress(prompt_len=20, page_size=16)
    prog.chunk_scheduled(20)
    assert prog.chunk_done(aborted=True) == (range(0), True)
    assert prog.sent_pages == 0


# -- early send ranges --------------------------------------------------------------------------


@pytest.mark.parametrize(("cached", "page_size", "expect"), [
    (0, 16, range(0)),
    (15, 16, range(0)),  # less than one page cached: nothing to send early
    (16, 16, range(0, 1)),
    (47, 16, range(0, 2)),
    (48, 16, range(0, 3)),
    (37, 1, range(0, 37)),
])
def test_early_send_sends_whole_cached_pages(cached, page_size, expect):
    assert SendProgress(100, page_size).early_send(cached) == expect


def test_early_send_stops_before_the_first_loading_page():
    prog = SendProgress(prompt_len=160, page_size=16)
    # pages 2 and 4 are still being written by a host->device load: only 0-1 go early
    assert prog.early_send(128, frozenset({2, 4})) == range(0, 2)
    assert prog.sent_pages == 2
    # the rest (loaded pages included) goes with the deferred sends, in prompt order
    assert run_chunks(prog, [160], overlap=False) == [range(2, 10)]


def test_early_send_with_the_first_page_loading_sends_nothing():
    prog = SendProgress(prompt_len=64, page_size=16)
    assert prog.early_send(48, frozenset({0})) == range(0)
    assert prog.sent_pages == 0
    assert run_chunks(prog, [64], overlap=True) == [range(0, 4)]


def test_loading_pages_beyond_the_cached_prefix_do_not_matter():
    prog = SendProgress(prompt_len=64, page_size=16)
    assert prog.early_send(32, frozenset({2, 3})) == range(0, 2)


def test_early_send_twice_never_resends():
    prog = SendProgress(prompt_len=100, page_size=16)
    assert prog.early_send(32) == range(0, 2)
    assert prog.early_send(32) == range(0)  # e.g. re-admitted after a failed admission
    assert prog.early_send(64) == range(2, 4)
    assert prog.early_send(16) == range(0)


def test_early_send_of_a_fully_cached_prompt_leaves_the_last_page_for_the_last_chunk():
    # the cache never covers the last prompt token (its logits give the first token)
    prog = SendProgress(prompt_len=64, page_size=16)
    assert prog.early_send(48) == range(0, 3)
    assert run_chunks(prog, [64], overlap=True) == [range(3, 4)]


# -- metadata rows and pool -----------------------------------------------------------------------


def test_metadata_row_round_trip():
    assert ROW_BYTES == 32
    for room, tok, lp in [(0, 0, 0.0), ((1 << 63) - 1, 151_935, -1.5), (12345, 7, -0.0)]:
        row = pack_row(room, tok, lp)
        assert len(row) == ROW_BYTES
        assert unpack_row(row) == (room, tok, lp)
    assert unpack_row(pack_row(5, 9)) == (5, 9, 0.0)
    assert pack_row(1, 2)[24:] == bytes(8)  # padding is zero


def test_metadata_row_is_little_endian_fixed_layout():
    row = pack_row(0x0102030405060708, 3, 0.5)
    assert row[:8] == bytes([8, 7, 6, 5, 4, 3, 2, 1])
    assert struct.unpack("<q", row[8:16]) == (3,)
    assert struct.unpack("<d", row[16:24]) == (0.5,)


@pytest.mark.parametrize("size", [0, 31, 33, 64])
def test_unpack_rejects_wrong_sizes(size):
    with pytest.raises(ValueError, match="32"):
        unpack_row(bytes(size))


def test_pack_rejects_out_of_range_room():
    with pytest.raises(struct.error):
        pack_row(-1, 0)
    with pytest.raises(struct.error):
        pack_row(1 << 64, 0)


def test_metadata_pool_alloc_free():
    pool = MetadataPool(3)
    assert pool.size == 3 and pool.num_free == 3
    assert tuple(pool.buffer.shape) == (3, ROW_BYTES)
    slots = [pool.alloc() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and pool.num_free == 0
    assert pool.alloc() is None  # exhausted: back-pressure, not an error
    pool.buffer[slots[1]] = 7
    pool.free(slots[1])
    assert pool.num_free == 1 and int(pool.buffer[slots[1]].sum()) == 0  # zeroed on free
    assert pool.alloc() == slots[1]
    for s in slots:
        pool.free(s)
    assert pool.num_free == 3


def test_metadata_pool_double_free_raises():
    pool = MetadataPool(2)
    s = pool.alloc()
    pool.free(s)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(s)
    assert pool.num_free == 2


def test_metadata_pool_row_bytes_are_what_was_written():
    pool = MetadataPool(4)
    s = pool.alloc()
    row = pack_row(99, 1234, -0.25)
    pool.buffer[s] = pool.buffer.new_tensor(list(row))
    assert unpack_row(bytes(pool.buffer[s].tolist())) == (99, 1234, -0.25)
