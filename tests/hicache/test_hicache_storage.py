"""HiCache's storage tier (pdserve/cache/kv_storage.py): objects round-trip bit-exact, a
corrupt or missing object ends the lookup (recompute, never wrong KV), a second node with
fresh pools finds what the first wrote, storage that fails is skipped and counted, and the
engine's greedy output on storage hits equals transformers."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
import torch
from hf_reference import hf_greedy
from hicache_helpers import PS, Tiers, tokens

from pdserve import LLM, SamplingParams
from pdserve.cache.kv_storage import FileStorage, PageStore, page_keys
from pdserve.cache.storage_prefetch import StoragePrefetcher


def objects(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def test_file_storage_round_trip_and_refuses_damaged_objects(tmp_path):
    st = FileStorage(str(tmp_path))
    payload = os.urandom(4096)
    st.put("ab" * 32, payload)
    assert st.exists("ab" * 32) and st.get("ab" * 32) == payload
    assert st.get("cd" * 32) is None and not st.exists("cd" * 32)
    (path,) = objects(tmp_path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # one flipped bit in the payload
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        st.get("ab" * 32)
    path.write_bytes(bytes(data[:10]))
    with pytest.raises(ValueError, match="truncated"):
        st.get("ab" * 32)


def test_page_keys_chain_the_whole_prefix_under_the_model_identity():
    a = list(range(4 * PS))
    b = [999] + a[1:]  # differs in the first page only
    ka, kb = page_keys("m", a, PS, 4), page_keys("m", b, PS, 4)
    assert len(set(ka)) == 4
    assert all(x != y for x, y in zip(ka, kb, strict=True))  # every later page differs too
    assert page_keys("m", a, PS, 2) == ka[:2]
    assert page_keys("other model", a, PS, 4)[0] != ka[0]


def with_store(root: Path, **kw) -> tuple[Tiers, PageStore]:
    t = Tiers(**kw)
    store = PageStore(FileStorage(str(root)), t.host, identity="toy")
    t.cache.store = store
    return t, store


def computed(t: Tiers, toks: list[int], seed: int) -> list[torch.Tensor]:
    """What a prefill leaves behind: device pages with KV, inserted (write-through backs
    them up and the copy thread writes them to storage)."""
    pages = t.alloc(len(toks) // PS)
    t.fill(pages, seed)
    data = t.pages_data(pages)
    assert t.cache.insert_dups(toks, pages) == []
    t.settle()
    return data


def written_by_a_first_node(root: Path, toks: list[int], seed: int) -> list[torch.Tensor]:
    """A node computes `toks` into the storage under `root` and closes."""
    t, _ = with_store(root)
    try:
        return computed(t, toks, seed)
    finally:
        t.close()


def fetched(t: Tiers, toks: list[int]) -> tuple[int, list[torch.Tensor] | None]:
    """A second node's admission: a storage prefetch, then match and load to the device."""
    pre = StoragePrefetcher(t.cache)
    op = pre.start(toks)
    pre.close()
    n = op.pages if op is not None else 0
    if not n:
        return 0, None
    m = t.cache.match(toks, count=False)
    loaded = t.cache.load_back(m, t.alloc)
    assert loaded is not None
    t.settle()
    return n, t.pages_data(loaded[0])


def test_a_second_node_reads_the_first_nodes_pages_bit_exact(tmp_path):
    toks = tokens(6, seed=1)
    p1, s1 = with_store(tmp_path)
    try:
        want = computed(p1, toks, seed=5)
        assert s1.stats["storage_written_pages"] == 6 and len(objects(tmp_path)) == 6
        p1.assert_full_after_reset()
    finally:
        p1.close()
    p2, s2 = with_store(tmp_path)
    try:
        p2.poison_free()  # a page storage did not really fill cannot pass as equal
        n, got = fetched(p2, toks)
        assert n == 6 and s2.stats["storage_hit_pages"] == 6
        assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
        assert p2.cache.stats["storage_hit_tokens"] == 6 * PS
        p2.identities()
        p2.assert_full_after_reset()
    finally:
        p2.close()


def test_a_corrupt_object_ends_the_hit_and_the_rest_is_recomputed(tmp_path):
    toks = tokens(6, seed=2)
    want = written_by_a_first_node(tmp_path, toks, seed=7)
    keys = page_keys("toy", toks, PS, 6)
    bad = tmp_path / keys[3][:2] / keys[3]
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    p2, s2 = with_store(tmp_path)
    try:
        n, got = fetched(p2, toks)
        assert n == 3 and s2.stats["storage_corrupt_pages"] == 1
        assert all(torch.equal(w[:3], g) for w, g in zip(want, got, strict=True))
        p2.identities()
        p2.assert_full_after_reset()
    finally:
        p2.close()
    # A missing object is a plain miss: only the pages before it.
    (tmp_path / keys[1][:2] / keys[1]).unlink()
    p3, s3 = with_store(tmp_path)
    try:
        assert fetched(p3, toks)[0] == 1 and s3.stats["storage_miss_lookups"] == 1
        p3.assert_full_after_reset()
    finally:
        p3.close()


def test_storage_that_fails_is_counted_and_skipped(tmp_path):
    root = tmp_path / "store"
    p1, s1 = with_store(root)
    try:
        root.rename(tmp_path / "gone")
        root.write_text("not a folder")  # every write below fails
        computed(p1, tokens(3, seed=3), seed=1)
        assert s1.stats["storage_errors"] >= 1 and s1.stats["storage_written_pages"] == 0
        assert p1.cache.stats["backups_skipped"] == 0  # the host tier still has them
        p1.identities()
        p1.assert_full_after_reset()
    finally:
        p1.close()


def test_fetch_stops_where_the_host_tier_is_full(tmp_path):
    toks = tokens(6, seed=4)
    written_by_a_first_node(tmp_path, toks, seed=2)
    p2, _ = with_store(tmp_path, host_pages=4)
    try:
        assert fetched(p2, toks)[0] == 4
        p2.identities()
        p2.assert_full_after_reset()
    finally:
        p2.close()


def test_one_prefetch_per_continuation_and_a_branch_computed_meanwhile_wins(tmp_path):
    """Two requests with one continuation share a read, which holds the node it hangs under;
    when the same pages get computed (and inserted) while the read is under way, the read's
    host pages go back to the pool, and nothing stays locked."""
    toks = tokens(5, seed=6)
    written_by_a_first_node(tmp_path, toks, seed=3)
    p2, s2 = with_store(tmp_path)
    try:
        computed(p2, toks[:2 * PS], seed=3)  # the first two pages are cached here already
        pre = StoragePrefetcher(p2.cache)
        op = pre.start(toks)
        assert op is not None and pre.start(toks + [1, 2, 3, 4]) is op
        assert op.start == 2 and op.node.lock_ref == 1
        pages = p2.alloc(3)  # the same three pages arrive by a prefill meanwhile
        p2.fill(pages, seed=9)
        assert p2.cache.insert_dups(toks, p2.cache.match(toks).device_pages + pages) == [0, 1]
        pre.close()
        p2.settle()  # the inserted branch's backup holds its path until acknowledged
        assert op.done and op.pages == 0 and s2.stats["storage_hit_pages"] == 3
        assert op.node.lock_ref == 0 and p2.cache.locked_pages == 0
        assert pre.start(toks) is None  # all on the device now: nothing to read
        p2.identities()
        p2.assert_full_after_reset()
    finally:
        p2.close()


MODEL = "tiny-llama"


def test_decode_goes_on_while_a_storage_read_is_slow(tmp_path):
    """The storage read of a waiting request's prefix runs off the scheduler thread: a
    request already decoding keeps getting tokens while the read is held up, the waiting
    one is admitted once its pages land, and both outputs equal transformers'."""
    import threading

    rng = random.Random(12)
    ids = [rng.randrange(100, 30000) for _ in range(160)]
    other = [rng.randrange(100, 30000) for _ in range(20)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    kw = dict(max_total_tokens=1024, enable_hierarchical_cache=True,
              hicache_storage_backend="file", hicache_storage_path=str(tmp_path))
    llm = LLM(MODEL, **kw)
    try:
        llm.generate([ids], params)
        llm.engine.kv.drain_copies()
    finally:
        llm.close()
    llm = LLM(MODEL, **kw)
    try:
        eng = llm.engine
        storage = eng.page_store.storage
        release = threading.Event()
        real_get = storage.get

        def slow_get(key):  # a storage server that answers only when the test says so
            release.wait(60)
            return real_get(key)

        storage.get = slow_get
        a = eng.add_request("a", other, SamplingParams(max_new_tokens=40, temperature=0.0,
                                                       ignore_eos=True))
        for _ in range(3):
            eng.step()
        b = eng.add_request("b", ids, params)
        deadline = time.monotonic() + 60
        while len(a.output_ids) < 12 and time.monotonic() < deadline:
            eng.step()
        assert len(a.output_ids) >= 12  # the scheduler did not block on the read
        assert b.slot is None and not b.output_ids and not b.prefetch.done
        release.set()
        while eng.has_work() and time.monotonic() < deadline:
            eng.step()
        eng.loop.drain()
        assert b.cached_tokens == (len(ids) - 1) // eng.cfg.page_size * eng.cfg.page_size
        assert tuple(b.output_ids) == hf_greedy(MODEL, tuple(ids), 6)
        assert tuple(a.output_ids) == hf_greedy(MODEL, tuple(other), 40)
        eng.kv.drain_copies()
        eng.flush_cache()
        assert eng.pools_full()
    finally:
        llm.close()


def test_engine_storage_hits_match_transformers(tmp_path):
    """Node 1 computes and writes; node 2 (fresh pools, same folder) reads the prefix from
    storage, and both greedy outputs equal transformers'."""
    rng = random.Random(11)
    ids = [rng.randrange(100, 30000) for _ in range(200)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(MODEL, max_total_tokens=1024, enable_hierarchical_cache=True,
                  hicache_storage_backend="file", hicache_storage_path=str(tmp_path))
        try:
            eng = llm.engine
            req = eng.add_request(f"r{len(runs)}", ids, params)
            deadline = time.monotonic() + 120
            while eng.has_work() and time.monotonic() < deadline:
                eng.step()
            eng.loop.drain()
            eng.kv.drain_copies()
            ps = eng.cfg.page_size
            runs.append((list(req.output_ids), req.cached_tokens,
                         dict(eng.hicache_stats()["storage"])))
            eng.kv.cache.reset()
            assert eng.pools_full()
        finally:
            llm.close()
    (out1, cached1, st1), (out2, cached2, st2) = runs
    assert cached1 == 0 and st1["storage_written_pages"] > 0
    assert cached2 == (len(ids) - 1) // ps * ps, cached2  # every whole page but the last token
    assert st2["storage_hit_pages"] == cached2 // ps and st2["storage_written_pages"] == 0
    assert tuple(out1) == tuple(out2) == hf_greedy(MODEL, tuple(ids), 6)


def test_a_stalled_storage_read_times_out_and_the_prompt_is_computed(tmp_path):
    """A storage that stops answering holds a request for at most
    --hicache-storage-prefetch-timeout-s; then it is computed (same tokens), storage counts
    as stalled (no new reads) until the stuck read ends, and nothing leaks."""
    import threading

    rng = random.Random(13)
    ids = [rng.randrange(100, 30000) for _ in range(160)]
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    kw = dict(max_total_tokens=1024, enable_hierarchical_cache=True,
              hicache_storage_backend="file", hicache_storage_path=str(tmp_path))
    llm = LLM(MODEL, **kw)
    try:
        llm.generate([ids], params)
        llm.engine.kv.drain_copies()
    finally:
        llm.close()
    llm = LLM(MODEL, hicache_storage_prefetch_timeout_s=0.5, **kw)
    release = threading.Event()
    try:
        eng = llm.engine
        storage = eng.page_store.storage
        real_get = storage.get

        def stuck_get(key):
            release.wait(60)
            return real_get(key)

        storage.get = stuck_get
        t0 = time.monotonic()
        out = llm.generate([ids], params)[0]
        assert 0.5 <= time.monotonic() - t0 < 30
        assert tuple(out.output_ids) == hf_greedy(MODEL, tuple(ids), 4)
        st = eng.hicache_stats()["storage"]
        assert st["storage_prefetch_timeouts"] == 1 and st["storage_hit_pages"] == 0
        assert eng.kv.prefetcher.stalled()
        eng.flush_cache()  # the prompt's own pages go: storage would be worth a read now
        more = llm.generate([ids[:100] + ids[:60]], params)[0]  # a miss: computed at once
        assert eng.kv.prefetcher.start(ids) is None  # stalled: no new read
        assert more.output_ids
        release.set()
        eng.kv.drain_copies()
        assert not eng.kv.prefetcher.stalled()
        eng.flush_cache()
        assert eng.pools_full()
    finally:
        release.set()
        llm.close()
