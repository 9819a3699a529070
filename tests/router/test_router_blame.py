"""Blame lands on the right node, with a real decode node's real 503: a router whose view
of the registry is stale still lists a prefill node ("ghost") that has left the registry.
The decode node refuses legs naming it with 503 `prefill_node_unavailable`; the router
charges the ghost (its breaker, its last error), leaves the decode nodes' breakers alone,
retries on the live prefill node, and every request succeeds token-exact."""

from __future__ import annotations

import uuid

import httpx
from router_harness import RouterProc, router_nodes

GHOST = f"ghost-prefill-{uuid.uuid4().hex[:6]}"
N_REQUESTS = 10


def test_decode_503_prefill_unavailable_blames_the_prefill_and_retries(stack, offline,
                                                                       tmp_path):
    registry = stack.registry
    ours = set(stack.urls.values())  # the stack's own prefill (other modules add nodes)
    real = httpx.get(f"{registry}/v1/nodes", params={"role": "prefill"}, timeout=10)
    record = next(n for n in real.json()["nodes"] if n["http_url"] in ours)
    ghost = {k: v for k, v in record.items()
             if k not in ("registered_at", "renewed_at", "expires_at", "generation",
                          "previous_instance_id")}
    ghost |= {"node_id": GHOST, "instance_id": uuid.uuid4().hex, "ttl_s": 600}
    # An idle ghost: a copied load (the real node busy with another module's traffic at
    # that moment) would sort it behind the real node forever, and it would never be picked.
    ghost["load"] = {k: 0 for k in ghost.get("load") or {}}
    put = httpx.put(f"{registry}/v1/nodes/{GHOST}", json=ghost, timeout=10)
    assert put.status_code == 201
    mine = {"X-Instance-Secret": put.json()["instance_secret"]}  # to delete it later
    # This router reads the registry at start and then only every 10 minutes: it keeps
    # the ghost after the ghost has left the registry. No prefix affinity: by load, ties
    # at random, so the ghost is chosen about every other time while its breaker allows.
    router = RouterProc(registry, tmp_path, "--registry-poll-s", "600", "--prefix-pages", "0",
                        "--dispatch-attempts", "3").spawn()
    try:
        url = router.wait_ready()
        assert GHOST in router_nodes(url)
        assert httpx.delete(f"{registry}/v1/nodes/{GHOST}", headers=mine,
                            timeout=10).status_code == 204

        # Requests until the ghost was picked (ties between the two prefill nodes are
        # broken at random), at least N_REQUESTS and at most 4x as many.
        for i in range(4 * N_REQUESTS):
            if i >= N_REQUESTS and router_nodes(url)[GHOST]["last_error"]:
                break
            ids = [100 + (7 * i + j) % 900 for j in range(20 + i % 30)]
            (w,) = offline.greedy([ids], 6)
            r = httpx.post(f"{url}/generate", timeout=120, json={
                "input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                      "ignore_eos": True}})
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == w.output_ids
            assert r.headers["x-pdserve-prefill-node"] != GHOST

        nodes = router_nodes(url)
        g = nodes[GHOST]
        assert g["last_error"] and "no live prefill node" in g["last_error"], g
        decodes = [n for n in nodes.values() if n["role"] == "decode"]
        assert any(n["legs"].get("peer_failed") for n in decodes), decodes  # ghost was hit
        for n in decodes:
            assert n["breaker"] == "closed" and not n["last_error"], n
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        retries = [line for line in metrics.splitlines()
                   if line.startswith("pdserve_router_retries_total")]
        assert retries and float(retries[0].split()[-1]) >= 1, retries
    finally:
        router.terminate()
        httpx.delete(f"{registry}/v1/nodes/{GHOST}", headers=mine, timeout=10)
