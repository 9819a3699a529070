"""HiCache's storage tier shared by the prefill nodes of one `pdserve up` stack
(`--hicache-storage-backend`): with a file tier, a prefix one prefill node computed is a
storage hit on the other once the first is gone (kill -9), through the router, and the output
is the same greedy tokens as transformers'; with mooncake, `up` starts a mooncake_master the
prefill nodes are pointed at, and stops it."""

from __future__ import annotations

import random

import httpx
import pytest
from hf_reference import hf_greedy
from router_harness import MODEL, Up, kill_group, server_info, wait_pools_full, wait_until

pytestmark = pytest.mark.timeout(420)


def storage(url: str) -> dict:
    return (server_info(url)["stats"].get("hicache") or {}).get("storage") or {}


def test_second_prefill_node_hits_what_the_first_wrote(tmp_path):
    up = Up(tmp_path, 2, 1, "--hicache-storage-backend", "file").start()
    try:
        rng = random.Random(5)
        ids = [rng.randrange(100, 30000) for _ in range(300)]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                      "ignore_eos": True}}
        first = httpx.post(f"{up.router}/generate", json=body, timeout=120)
        assert first.status_code == 200, first.text
        p1 = first.headers["x-pdserve-prefill-node"]
        (p2,) = {"prefill-0", "prefill-1"} - {p1}
        wait_until(lambda: storage(up.urls[p1]).get("storage_written_pages", 0) > 0, 30,
                   f"{p1} to write the prompt's pages")
        kill_group(up.pids[p1])
        # The router retries a request whose prefill node is gone on the live one.
        second = httpx.post(f"{up.router}/generate", json=body, timeout=120)
        assert second.status_code == 200, second.text
        assert second.headers["x-pdserve-prefill-node"] == p2
        wait_until(lambda: storage(up.urls[p2]).get("storage_hit_pages", 0) > 0, 10,
                   f"{p2}'s stats to show the storage hit")
        want = list(hf_greedy(MODEL, tuple(ids), 6))
        assert first.json()["output_ids"] == second.json()["output_ids"] == want
        wait_pools_full(up.urls[p2])
        wait_pools_full(up.urls["decode-0"])
    finally:
        up.stop()


def test_with_mooncake_a_live_prefill_node_hits_what_the_other_computed(tmp_path):
    """`up --hicache-storage-backend mooncake` starts a mooncake_master for the prefill
    nodes (and stops it); with prefix affinity off (`--prefix-pages 0`) the same prompt
    lands on the other prefill node, which reads the pages the first one put into the
    store, from that node's memory segment, while it lives."""
    import psutil

    up = Up(tmp_path, 2, 1, "--hicache-storage-backend", "mooncake",
            "--router-args", "--prefix-pages 0").start()
    try:
        kv_store_url = up.urls["kv-store"]
        assert "--hicache-storage-backend" not in " ".join(
            psutil.Process(up.pids["decode-0"]).cmdline())
        for name in ("prefill-0", "prefill-1"):
            wait_until(lambda n=name: storage(up.urls[n]).get("storage_up") == 1, 120,
                       f"{name} to connect to the stack's mooncake_master")
        rng = random.Random(6)
        ids = [rng.randrange(100, 30000) for _ in range(300)]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                      "ignore_eos": True}}
        want = list(hf_greedy(MODEL, tuple(ids), 6))
        first = httpx.post(f"{up.router}/generate", json=body, timeout=120)
        assert first.status_code == 200, first.text
        assert first.json()["output_ids"] == want
        p1 = first.headers["x-pdserve-prefill-node"]
        (p2,) = {"prefill-0", "prefill-1"} - {p1}
        wait_until(lambda: storage(up.urls[p1]).get("storage_written_pages", 0) > 0, 30,
                   f"{p1} to put the prompt's pages into the store")
        # Load-only picking breaks ties at random: 2^-20 that p2 is never picked.
        for _ in range(20):
            again = httpx.post(f"{up.router}/generate", json=body, timeout=120)
            assert again.status_code == 200, again.text
            assert again.json()["output_ids"] == want
            if again.headers["x-pdserve-prefill-node"] == p2:
                break
        assert again.headers["x-pdserve-prefill-node"] == p2
        wait_until(lambda: storage(up.urls[p2]).get("storage_hit_pages", 0) > 0, 10,
                   f"{p2}'s stats to show the storage hit")
        assert again.json()["meta_info"]["cached_tokens"] >= 288
        wait_pools_full(up.urls[p2])
        wait_pools_full(up.urls["decode-0"])
    finally:
        up.stop()
    with pytest.raises(httpx.TransportError):
        httpx.get(kv_store_url, timeout=2)
