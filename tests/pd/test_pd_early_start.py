"""Prefill early start (prefill_node/role.py, step 2; docs/architecture.md: Prefill node): a
prefill request runs its forward before its decode node pre-allocated, its KV queued on the
sender until the decode says where to write, within the early-start cap.

In process (a 1P1D cluster, tcp): the forward finishes before the decode leg even exists,
and the output is token-exact; cap 0 keeps the request in the bootstrap queue; the cap lets
only as many prompt pages start early as it allows; a decode that never asks times the
request out with every pool back to full; an abort after an early start frees everything.
With real processes: the prefill node answers its leg only after a decode leg sent late,
token-exact, and both nodes end with full pools.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from pd_pair import (
    PDCluster,
    assert_failed,
    assert_ok,
    colocated_greedy,
    greedy,
    random_prompt,
)
from pd_procs import Node, Registry, post_leg

from kv_transfer import KVPoll

MODEL = "tiny-llama"
BOOTSTRAP_TIMEOUT_S = 8.0  # long enough for a loaded machine between two steps
TRANSFER = {"bootstrap_timeout_s": BOOTSTRAP_TIMEOUT_S, "transfer_timeout_s": 20.0}
N = 8
PROMPT = random_prompt(40, seed=11)
LONG = random_prompt(200, seed=12)


@pytest.fixture(scope="module")
def cluster() -> Iterator[PDCluster]:
    c = PDCluster(MODEL, "tcp", prefills=[{"chunked_prefill_size": 64}], transfer=TRANSFER)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def pd(cluster) -> Iterator[PDCluster]:
    role = cluster.prefills[0].role
    cap = role.early_start_kv_fraction
    cluster.reset_caches()
    yield cluster
    role.early_start_kv_fraction = cap
    cluster.run(timeout=60)
    cluster.assert_pools_full()


def run_prefill_until(pd: PDCluster, cond, timeout: float = 30) -> None:
    pd.run(timeout=timeout, until=cond, engines=pd.prefills)


def test_forward_finishes_before_the_decode_asks_and_output_is_exact(pd):
    pe = pd.prefills[0]
    started = pe.role.stats()["early_started"]
    leg = pd.submit(PROMPT, greedy(N), legs="p")  # no decode leg yet: nobody asks
    run_prefill_until(pd, lambda: leg.prefill in pe.role.inflight)
    # The first token is computed, every page queued, and the decode never asked.
    assert len(leg.prefill.output_ids) == 1 and leg.prefill.error is None
    assert leg.prefill.pd.sender.poll() == KVPoll.Bootstrapping
    assert leg.prefill in pe.role.early
    assert pe.role.stats()["early_started"] == started + 1
    late = pd.submit(PROMPT, greedy(N), room=leg.room, legs="d")
    pd.run(timeout=60)
    assert leg.prefill.error is None and leg.prefill.finish_reason == "length"
    assert late.decode.error is None, late.decode.error
    assert late.output_ids == colocated_greedy(MODEL, [PROMPT], N)[0]
    assert late.output_ids[:1] == leg.prefill.output_ids
    assert not pe.role.early


def test_early_start_with_both_legs_at_once_is_exact(pd):
    legs = pd.generate([PROMPT, LONG], greedy(N))
    want = colocated_greedy(MODEL, [PROMPT, LONG], N)
    assert [leg.output_ids for leg in legs] == want


def test_cap_zero_waits_in_the_bootstrap_queue(pd):
    pe = pd.prefills[0]
    pe.role.early_start_kv_fraction = 0.0
    started = pe.role.stats()["early_started"]
    leg = pd.submit(PROMPT, greedy(N), legs="p")
    for _ in range(20):
        pd.step(engines=pd.prefills)
    assert leg.prefill in pe.role.bootstrap and not leg.prefill.output_ids
    assert not pe.sched.waiting and leg.prefill.pd.meta_slot is None
    late = pd.submit(PROMPT, greedy(N), room=leg.room, legs="d")
    pd.run(timeout=60)
    assert late.output_ids == colocated_greedy(MODEL, [PROMPT], N)[0]
    assert pe.role.stats()["early_started"] == started


def test_cap_bounds_the_pages_of_requests_started_early(pd):
    pe = pd.prefills[0]
    pages = -(-len(LONG) // pe.kv.page_size)
    # Room for one LONG prompt's pages, not two.
    pe.role.early_start_kv_fraction = (pages * 1.5) / pe.role.pool_pages
    first = pd.submit(LONG, greedy(N), legs="p")
    second = pd.submit(random_prompt(200, seed=13), greedy(N), legs="p")
    run_prefill_until(pd, lambda: first.prefill in pe.role.inflight)
    for _ in range(10):
        pd.step(engines=pd.prefills)
    assert first.prefill in pe.role.early
    assert second.prefill in pe.role.bootstrap and not second.prefill.output_ids
    # Once the first one's decode asked, its pages no longer count: the second starts.
    d1 = pd.submit(LONG, greedy(N), room=first.room, legs="d")
    pd.run(timeout=60, until=lambda: second.prefill not in pe.role.bootstrap)
    assert second.prefill.error is None, second.prefill.error
    assert second.prefill in pe.role.early
    d2 = pd.submit(second.prefill.prompt_ids, greedy(N), room=second.room, legs="d")
    pd.run(timeout=60)
    assert d1.decode.error is None and d2.decode.error is None
    assert d1.output_ids == colocated_greedy(MODEL, [LONG], N)[0]


def test_decode_that_never_asks_times_out_and_frees_everything(pd):
    pe = pd.prefills[0]
    leg = pd.submit(PROMPT, greedy(N), legs="p")
    run_prefill_until(pd, lambda: leg.prefill in pe.role.inflight)
    t0 = time.monotonic()
    pd.run(timeout=BOOTSTRAP_TIMEOUT_S + 30, engines=pd.prefills)
    assert leg.prefill.error and "bootstrap timeout" in leg.prefill.error, leg.prefill.error
    assert time.monotonic() - t0 < BOOTSTRAP_TIMEOUT_S + 20
    assert not pe.role.early and not pe.role.inflight
    pd.assert_pools_full()


@pytest.mark.parametrize("when", ["queued", "forward done"])
def test_abort_during_early_start_frees_everything(pd, when):
    pe = pd.prefills[0]
    leg = pd.submit(LONG, greedy(N), legs="p")
    if when == "queued":
        pd.step(engines=pd.prefills)  # started: in the waiting queue (or its first chunk)
        assert leg.prefill in pe.role.live and leg.prefill in pe.role.early
    else:
        run_prefill_until(pd, lambda: leg.prefill in pe.role.inflight)
    assert pe.abort(leg.rid)
    pd.run(timeout=30, engines=pd.prefills)
    assert leg.prefill.error, leg.prefill.error
    if when == "queued":
        assert_failed(leg.prefill, "prefill leg")
    assert not pe.role.early
    pd.assert_pools_full()
    # A decode that asks now hears the room is gone, and frees what it pre-allocated.
    late = pd.submit(LONG, greedy(N), room=leg.room, legs="d")
    pd.run(timeout=BOOTSTRAP_TIMEOUT_S + 30)
    assert_failed(late.decode, "decode leg")
    pd.assert_pools_full()


def test_early_start_does_not_change_a_normal_pair(pd):
    """Both legs at once, as the router sends them, several times: all exact, pools full."""
    prompts = [random_prompt(24 + 9 * i, seed=20 + i) for i in range(4)]
    legs = pd.generate(prompts, greedy(N))
    for leg in legs:
        assert_ok(leg)
    assert [leg.output_ids for leg in legs] == colocated_greedy(MODEL, prompts, N)


# -- real processes -----------------------------------------------------------------------

KV_FLAGS = ["--kv-bootstrap-timeout-s", "20", "--kv-transfer-timeout-s", "20"]


def test_processes_prefill_computes_before_a_late_decode_leg(tmp_path):
    registry = Registry(tmp_path)
    nodes: list[Node] = []
    try:
        registry.start()
        prefill = Node("prefill", "tcp", registry, tmp_path, MODEL, KV_FLAGS)
        decode = Node("decode", "tcp", registry, tmp_path, MODEL, KV_FLAGS)
        nodes += [prefill, decode]
        for node in nodes:
            node.spawn()
        for node in nodes:
            node.wait_ready()
        room = 0x5EED_0001
        body = {"input_ids": PROMPT, "bootstrap_room": room,
                "sampling_params": {"max_new_tokens": N, "temperature": 0.0,
                                    "ignore_eos": True}}
        results: dict = {}
        t = threading.Thread(target=lambda: results.update(p=post_leg(prefill.url, body)),
                             daemon=True)
        t.start()
        # The prefill computed the first token and holds the KV for a decode that has not
        # asked yet (it has not even heard of the request).
        deadline = time.monotonic() + 60
        while True:
            role = prefill.stats().get("role", {})
            if role.get("early_started", 0) >= 1 and role.get("inflight_queue") == 1:
                break
            assert time.monotonic() < deadline, f"no early start: {prefill.info()}"
            time.sleep(0.05)
        assert "p" not in results  # the leg waits for the transfer
        d = post_leg(decode.url, {**body, "prefill_node_id": prefill.node_id})
        t.join(60)
        p = results["p"]
        assert p.status == 200, (p.status, p.body, p.error)
        assert d.status == 200, (d.status, d.body, d.error)
        assert d.body["output_ids"] == colocated_greedy(MODEL, [PROMPT], N)[0]
        assert p.body["output_ids"] == d.body["output_ids"][:1]
        prefill.wait_pools_full()
        decode.wait_pools_full()
    finally:
        for node in nodes:
            node.stop()
        registry.stop()
