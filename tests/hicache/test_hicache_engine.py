"""HiCache in the engine: a prefix forced out to the host tier is loaded back and the
greedy output still equals transformers; the load for batch N+1 starts while forward N
runs; an abort during a load leaks nothing (docs/architecture.md: HiCache)."""

from __future__ import annotations

import os
import random
import time

import hf_reference
import pytest
import torch

from pdserve import LLM, SamplingParams

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(int(os.environ.get("PDSERVE_TEST_THREADS", "1")))
    engine = LLM(MODEL, max_total_tokens=1024, enable_hierarchical_cache=True, loop="overlap")
    yield engine
    engine.close()


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def hf_greedy(ids: tuple[int, ...], n: int) -> tuple[int, ...]:
    return hf_reference.hf_greedy(MODEL, ids, n)


def force_to_host(llm: LLM) -> None:
    """Evict every cached prefix from the device (write-through: host copies stay), then
    poison the freed device pages so KV that was not loaded back cannot pass unseen
    (a large finite value, not NaN: attention multiplies masked-out keys by 0)."""
    eng = llm.engine
    assert eng.pools_full()  # also waits for pending backups
    eng.kv.cache.evict(eng.kv.cache.total_pages)
    free = list(eng.kv_pool.allocator._free)
    for buf in eng.kv_pool.k_buffers + eng.kv_pool.v_buffers:
        buf.view(eng.kv_pool.num_pages, eng.cfg.page_size, *buf.shape[1:])[free] = 1000.0


def assert_both_tiers_full(llm: LLM) -> None:
    eng = llm.engine
    assert eng.pools_full(), eng.memory_stats()
    eng.kv.cache.reset()
    s = eng.memory_stats()
    assert s["free_pages"] == s["total_pages"], s
    assert s["host_free_pages"] == s["host_total_pages"], s


def test_prefix_from_host_matches_transformers(llm):
    doc = prompt(200, seed=1)
    first, second = doc + prompt(5, seed=2), doc + prompt(9, seed=3)
    llm.generate([first], greedy(4))
    force_to_host(llm)
    hits = llm.engine.memory_stats()["host_hit_tokens"]
    out = llm.generate([second], greedy(12))[0]
    assert tuple(out.output_ids) == hf_greedy(tuple(second), 12)
    assert llm.engine.memory_stats()["host_hit_tokens"] - hits >= 192
    assert_both_tiers_full(llm)


def test_load_for_next_batch_overlaps_the_running_forward(llm):
    eng = llm.engine
    doc = prompt(160, seed=4)
    llm.generate([doc + [7]], greedy(2))
    force_to_host(llm)
    runner, ctrl = eng.executor.runner, eng.hicache
    real_run, held = runner.run, {}
    loads_before = ctrl.stats["load_ops"]  # the engine is shared with the module's other tests

    def run(batch):
        if not held:  # forward N: keep it running until the load for N+1 has run (waiting
            # only for its submission left the start to the copy thread's wake-up time)
            held["seq"] = batch.seq
            deadline = time.monotonic() + 60
            while ctrl.stats["load_ops"] == loads_before and time.monotonic() < deadline:
                time.sleep(0.001)
        return real_run(batch)

    runner.run = run
    try:
        a = eng.add_request("overlap-a", prompt(60, seed=5), greedy(3))
        eng.step()  # builds and launches forward N (request a)
        b_ids = doc + prompt(6, seed=6)
        b = eng.add_request("overlap-b", b_ids, greedy(6))
        while eng.has_work():
            eng.step()
        eng.loop.drain()
    finally:
        runner.run = real_run
    fwd = {seq: (t0, t1) for seq, t0, t1 in runner.timeline}
    loads = [op for op in ctrl.timeline if op.kind == "load"]
    assert loads, "no HiCache load happened"
    n_end = fwd[held["seq"]][1]
    assert loads[-1].t_submit < n_end and loads[-1].t_start < n_end, \
        "the load for batch N+1 did not start before forward N ended"
    assert tuple(b.output_ids) == hf_greedy(tuple(b_ids), 6)
    assert a.finish_reason == "length"
    assert_both_tiers_full(llm)


def test_abort_during_load_leaks_nothing(llm):
    eng = llm.engine
    doc = prompt(128, seed=8)
    llm.generate([doc + [9]], greedy(2))
    force_to_host(llm)
    eng.hicache.gate.clear()
    try:
        eng.add_request("abort-me", doc + [11, 12], greedy(4))
        eng.step()  # admitted, load issued, forward launched (it waits for the load)
        assert eng.hicache.is_loading()
        assert eng.abort("abort-me")
        assert eng.kv.cache.locked_pages > 0  # the load still locks its nodes
    finally:
        eng.hicache.gate.set()
    while eng.has_work():
        eng.step()
    eng.loop.drain()
    assert_both_tiers_full(llm)
    # The aborted load completed into pages the tree owns: the next request reuses them.
    out = llm.generate([doc + [13]], greedy(5))[0]
    assert tuple(out.output_ids) == hf_greedy(tuple(doc + [13]), 5)


def test_second_request_on_a_loading_prefix_knows_it_is_loading(llm):
    eng = llm.engine
    doc = prompt(96, seed=12)
    llm.generate([doc + [3]], greedy(2))
    force_to_host(llm)
    eng.hicache.gate.clear()
    try:
        first = eng.add_request("share-1", doc + [4, 5], greedy(3))
        second = eng.add_request("share-2", doc + [6, 7, 8], greedy(3))
        eng.step()  # both admitted in one batch: the first loads, the second shares it
        assert eng.kv.loading_pages(first) == frozenset(range(6))
        assert eng.kv.loading_pages(second) == frozenset(range(6))
    finally:
        eng.hicache.gate.set()
    while eng.has_work():
        eng.step()
    eng.loop.drain()
    assert eng.kv.loading_pages(second) == frozenset()
    for req in (first, second):
        ids = tuple(req.prompt_ids)
        assert tuple(req.output_ids) == hf_greedy(ids, 3)
    assert_both_tiers_full(llm)


def test_abort_during_backup_leaks_nothing(llm):
    """A request aborted while the backup of its prefix to the host tier is still held
    (write-through, copy gated): a finished request's pages are being backed up when a
    second request on the same prefix is admitted and aborted mid-decode. The backup keeps
    its nodes locked until it lands; then both tiers are full and the host copy serves."""
    eng = llm.engine
    cache = eng.kv.cache
    doc = prompt(112, seed=21)
    eng.hicache.gate.clear()
    try:
        llm.generate([doc + [5]], greedy(2))  # finished: its pages' backup is queued
        assert cache._pending, "no backup was queued"
        req = eng.add_request("backup-abort", doc + [6, 7], greedy(30))
        for _ in range(4):
            eng.step()
        assert req.output_ids and cache._pending  # decoding on the prefix being backed up
        assert eng.abort("backup-abort")
        while eng.has_work():
            eng.step()
        eng.loop.drain()
        assert cache._pending and cache.locked_pages > 0  # the held backup still locks
    finally:
        eng.hicache.gate.set()
    assert_both_tiers_full(llm)
    # The copy that landed after the abort is a real host copy: a later request hits it.
    llm.generate([doc + [8]], greedy(2))
    force_to_host(llm)
    before = cache.stats["host_hit_tokens"]
    out = llm.generate([doc + [9]], greedy(4))[0]
    assert cache.stats["host_hit_tokens"] > before
    assert tuple(out.output_ids) == hf_greedy(tuple(doc + [9]), 4)
    assert_both_tiers_full(llm)


def test_admission_blocked_by_a_backup_waits_for_it_instead_of_spinning(llm):
    """A prompt that fits only once a running backup unlocks the previous prompt's pages
    (write-through locks a node until its host copy lands) waits for that copy with the
    GIL released. Retrying at once instead starves the copy thread of the GIL: each step
    is pure Python, and one backup took seconds (TTFT 13x worse with HiCache on)."""
    from pdserve.engine.scheduler import COPY_WAIT_S

    eng = llm.engine
    first, second = prompt(600, seed=31), prompt(600, seed=32)
    eng.hicache.gate.clear()
    try:
        llm.generate([first], greedy(1))  # finished: its 600 tokens are locked by the backup
        assert eng.kv.cache._pending, "no backup was queued"
        req = eng.add_request("after-backup", second, greedy(3))
        steps0, t0 = eng.loop.stats.steps, time.perf_counter()
        while time.perf_counter() - t0 < 0.3:
            eng.step()
        steps = eng.loop.stats.steps - steps0
        assert not req.output_ids, "admitted although the backup still locks the pages"
        # Each step waited for the copy: at most one per COPY_WAIT_S (+ slack), where a
        # spinning scheduler makes thousands.
        assert steps <= 0.3 / COPY_WAIT_S + 10, f"{steps} steps in 0.3 s: the scheduler spins"
    finally:
        eng.hicache.gate.set()
    while eng.has_work():
        eng.step()
    eng.loop.drain()
    assert tuple(req.output_ids) == hf_greedy(tuple(second), 3)
    assert_both_tiers_full(llm)
