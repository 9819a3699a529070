"""A decode node under KV pressure (small pool, many long requests) queues requests in
pre-allocation instead of failing them, and every request completes token-exact
(docs/architecture.md: Request lifecycles: back-pressure, never failure). With a small decode
reservation the
decode runs out of pages while decoding and retracts (then re-prefills locally); retracted
requests are not starved by new transfers that keep arriving."""

from __future__ import annotations

import threading
import time

import pytest
from pd_pair import PDCluster, assert_ok, colocated_greedy, greedy, random_prompt

MODEL = "tiny-llama"
N = 40
PROMPTS = [random_prompt(90 + 7 * i, seed=2000 + i) for i in range(14)]  # 90..181 tokens
DECODE_POOL = 512  # tokens: room for about two of these requests at a time


@pytest.mark.parametrize(("backend", "reserve", "hicache"),
                         [("mooncake", 64, False), ("tcp", 4, False), ("tcp", 4, True)],
                         ids=["mooncake-reserve64", "tcp-reserve4-retracts",
                              "tcp-reserve4-retracts-hicache"])
def test_decode_under_kv_pressure_queues_then_completes(backend, reserve, hicache):
    """With HiCache on the decode node, a retracted request's KV goes to the host tier (its
    pages are cached on retraction; write-through keeps a host copy when the device evicts
    them) and comes back from there instead of being re-prefilled."""
    cluster = PDCluster(
        MODEL, backend, prefills=[{"page_size": 4, "chunked_prefill_size": 64}],
        decodes=[{"page_size": 4, "max_total_tokens": DECODE_POOL,
                  "decode_reserve_tokens": reserve, "chunked_prefill_size": 64,
                  "enable_hierarchical_cache": hicache}])
    try:
        de = cluster.decodes[0]
        assert de.max_total_tokens == DECODE_POOL
        legs = [cluster.submit(p, greedy(N)) for p in PROMPTS]
        max_prealloc = max_admitted = 0
        deadline = time.monotonic() + 120
        while cluster.busy():
            assert time.monotonic() < deadline, cluster.dump()
            cluster.step()
            max_prealloc = max(max_prealloc, len(de.role.prealloc))
            admitted = len(de.role.transferring) + len(de.sched.running) + \
                len(de.sched.waiting)
            max_admitted = max(max_admitted, admitted)
        for e in cluster.engines:
            e.loop.drain()
        want = colocated_greedy(MODEL, PROMPTS, N)
        for leg, w in zip(legs, want, strict=True):
            assert_ok(leg)
            assert leg.output_ids == w, f"prompt of {len(leg.decode.prompt_ids)} tokens"
        assert max_prealloc > 0, "no request ever waited in the pre-allocation queue"
        assert max_admitted < len(PROMPTS)
        if reserve < 16:
            assert de.sched.num_retractions > 0, "expected the decode to retract"
            assert any(leg.decode.retractions for leg in legs)
        assert de.role.mgr.metrics()["rooms_failed"] == 0
        if hicache:
            assert de.kv.cache.stats["host_hit_tokens"] > 0, "nothing came back from the host"
        cluster.assert_pools_full()
    finally:
        cluster.close()


def test_prefill_under_kv_pressure_keeps_early_sent_pages_valid():
    """A prefill with a tight pool: B's prefix is cached, its cached pages go out early, but
    B cannot be admitted yet (R runs and needs the pool). Whatever the scheduler does with
    B, pages it queued for sending must keep their content until the transfer read them:
    R must not evict and overwrite them meanwhile. The prefill's transfer thread is held
    (as when it is busy with other rooms) so that the transfer reads the pages late."""
    cluster = PDCluster(
        MODEL, "tcp",
        prefills=[{"page_size": 16, "max_total_tokens": 640, "chunked_prefill_size": 64,
                   "disable_overlap": True}],
        decodes=[{"page_size": 16}])
    gate = threading.Event()
    try:
        pe = cluster.prefills[0]
        a = random_prompt(300, seed=2101)
        cluster.generate([a], greedy(4))  # the prefill caches a's 18 whole pages
        cluster.reset_caches("d")  # the decode must receive the prefix from the prefill
        pe.role.mgr.run_on_transfer_thread(lambda _backend: gate.wait(30))
        r = random_prompt(600, seed=2102)  # needs nearly the whole prefill pool
        b = a[:288] + random_prompt(200, seed=2103)
        leg_r, leg_b = cluster.submit(r, greedy(N)), cluster.submit(b, greedy(N))
        cluster.run(timeout=20, until=lambda: leg_r.prefill in pe.role.inflight)
        gate.set()
        cluster.run(timeout=60)
        want = colocated_greedy(MODEL, [r, b], N)
        assert_ok(leg_r)
        assert_ok(leg_b)
        assert leg_r.output_ids == want[0]
        assert leg_b.output_ids == want[1], \
            "B's decode received KV pages that were overwritten after they were queued"
        cluster.assert_pools_full()
    finally:
        gate.set()
        cluster.close()


def test_retracted_requests_finish_while_new_transfers_keep_arriving():
    """A decode under KV pressure retracts requests while new transfers keep arriving (the
    pre-allocation queue is never empty). New pre-allocations must not take the pages the
    retracted requests wait for, and a retracted request is not the victim again while
    others can go: each retracted request finishes within a bounded number of decode steps
    of its first retraction, long before the arrivals stop."""
    feed_steps, bound = 700, 250  # decode steps with arrivals; most steps to finish
    cluster = PDCluster(
        MODEL, "mooncake", prefills=[{"page_size": 4, "chunked_prefill_size": 64}],
        decodes=[{"page_size": 4, "max_total_tokens": DECODE_POOL, "decode_reserve_tokens": 4,
                  "chunked_prefill_size": 64, "max_running_requests": 16}])
    try:
        de = cluster.decodes[0]
        legs, retracted_at, finished_at = [], {}, {}
        deadline = time.monotonic() + 240
        while de.loop.stats.steps < feed_steps or cluster.busy():
            assert time.monotonic() < deadline, cluster.dump()
            if de.loop.stats.steps < feed_steps and len(de.role.prealloc) < 3:
                i = len(legs)
                legs.append(cluster.submit(random_prompt(60 + 13 * i % 40, seed=2200 + i),
                                           greedy(N)))
            cluster.step()
            step = de.loop.stats.steps
            for leg in legs:
                if leg.decode.retractions and leg.rid not in retracted_at:
                    retracted_at[leg.rid] = step
                if leg.decode.finished and leg.rid not in finished_at:
                    finished_at[leg.rid] = step
        for e in cluster.engines:
            e.loop.drain()
        early = [rid for rid, s in retracted_at.items() if s < feed_steps - bound]
        assert len(early) >= 3, f"too few retractions to tell: {retracted_at}"
        waits = {rid: finished_at[rid] - retracted_at[rid] for rid in early}
        assert max(waits.values()) <= bound, f"retracted requests starved: {waits}"
        want = colocated_greedy(MODEL, [leg.decode.prompt_ids for leg in legs], N)
        for leg, w in zip(legs, want, strict=True):
            assert_ok(leg)
            assert leg.output_ids == w
        assert de.role.mgr.metrics()["rooms_failed"] == 0
        cluster.assert_pools_full()
    finally:
        cluster.close()
