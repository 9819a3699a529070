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


def test_up_starts_and_stops_a_mooncake_master_for_the_prefill_nodes(tmp_path):
    import time

    from pdserve.cache.kv_storage import MooncakeStorage
    from pdserve.stack.config import StackConfig
    from pdserve.stack.stack import Stack

    cfg = StackConfig(model=MODEL, prefill=1, decode=1, hicache_storage_backend="mooncake",
                      log_dir=str(tmp_path), transfer_backend="tcp")
    stack = Stack(cfg, say=lambda *_: None)
    try:
        stack._start_kv_store(time.monotonic() + 60)
        pre = stack._node("prefill-0", "prefill", 1).child.cmd
        dec = stack._node("decode-0", "decode", 2).child.cmd
        assert "--hicache-storage-backend" in pre and "--hicache-storage-backend" not in dec
        master = pre[pre.index("--hicache-mooncake-master") + 1]
        url = pre[pre.index("--hicache-mooncake-metadata-url") + 1]
        st = MooncakeStorage(master, url, "127.0.0.1", 16, "tcp")
        try:
            wait_until(lambda: st.up, 60, "a client to connect to the stack's master")
            st.put("k", b"v" * 100)
            assert st.get("k") == b"v" * 100
        finally:
            st.close()
        (member,) = [m for m in stack.members if m.name == "kv-store"]
    finally:
        stack.stop()
    assert member.child.exited() is not None
