"""PD with real processes over real HTTP: one registry and a prefill + decode node per
transfer backend, shared by the module (started once, always torn down). A request's two
legs go to the nodes concurrently, as the router will send them.

- a /generate round trip, plain and streaming, token-exact, on both backends;
- legs that cannot work are refused at once with a clear 400;
- kill -9 of the prefill node (HTTP process and scheduler) while transfers are pending:
  every unfinished decode leg gets an error within the configured bound, and the decode
  node's KV pages, request slots and metadata slots return to full.
The kill tests run last: they take the prefill nodes down (a later test would restart one).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from pd_pair import BACKENDS, colocated_greedy, random_prompt
from pd_procs import Node, PDRequest, Registry

MODEL = "tiny-llama"
KV_FLAGS = ["--kv-heartbeat-interval-s", "0.5", "--kv-heartbeat-misses", "4",  # 2 s
            "--kv-transfer-timeout-s", "6", "--kv-bootstrap-timeout-s", "4"]
# The prefill takes at most 64 prompt tokens per batch, so a long prompt takes many steps.
PREFILL_FLAGS = ["--max-total-tokens", "8192", "--chunked-prefill-size", "32",
                 "--max-prefill-tokens", "64", *KV_FLAGS]
DECODE_FLAGS = ["--max-total-tokens", "4096", *KV_FLAGS]
# Worst case for a decode leg after its prefill dies: a room not yet requested waits for
# the bootstrap timeout (4 s); a requested one for the heartbeat (0.5 s x 2).
KILL_BOUND_S = 4 + 6  # the bootstrap timeout plus slack for a loaded machine
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


class Stack:
    def __init__(self, registry: Registry, log_dir) -> None:
        self.registry, self.log_dir = registry, log_dir
        self.nodes: dict[tuple[str, str], Node] = {}

    def add(self, role: str, backend: str) -> Node:
        flags = PREFILL_FLAGS if role == "prefill" else DECODE_FLAGS
        node = Node(role, backend, self.registry, self.log_dir, MODEL, flags)
        self.nodes[(role, backend)] = node
        node.spawn()
        return node

    def node(self, role: str, backend: str) -> Node:
        """The live node (restarted if an earlier test killed it)."""
        node = self.nodes[(role, backend)]
        if not node.alive:
            node.stop()
            node = self.add(role, backend).wait_ready()
        return node

    def close(self) -> None:
        for node in self.nodes.values():
            node.stop()
        self.registry.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("pd-stack")
    s = Stack(Registry(log_dir), log_dir)
    try:
        s.registry.start()
        for backend in BACKENDS:  # all start at once: start-up is mostly imports
            s.add("prefill", backend)
            s.add("decode", backend)
        for node in s.nodes.values():
            node.wait_ready()
        yield s
    finally:
        s.close()


def check_decode_body(body: dict, want: list[int]) -> None:
    assert body["output_ids"] == want, body
    assert body["meta_info"]["finish_reason"] == "length"
    assert body["meta_info"]["completion_tokens"] == len(want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_http_round_trip(stack, backend):
    prefill, decode = stack.node("prefill", backend), stack.node("decode", backend)
    before = decode.fresh_stats()["role"]["transfer"]["rooms_succeeded"]
    prompts = [random_prompt(23, seed=3001), random_prompt(150, seed=3002)]
    want = colocated_greedy(MODEL, prompts, GREEDY["max_new_tokens"])
    reqs = [PDRequest(prefill, decode, p, GREEDY, stream=stream).start()
            for stream in (False, True) for p in prompts]
    for r in reqs:
        r.join()
    for i, r in enumerate(reqs):
        w = want[i % len(prompts)]
        p, d = r.prefill, r.decode
        assert p.status == 200 and d.status == 200, (p, d)
        # the prefill leg returns once its KV transfer finished, with the first token
        assert p.body["output_ids"] == w[:1] and p.body["meta_info"]["completion_tokens"] == 1
        if d.events:  # streamed
            assert d.events[-1] == "[DONE]", d.events[-3:]
            objs = d.events[:-1]
            assert objs and not any("error" in e for e in objs), objs
            check_decode_body(objs[-1], w)
            assert all(e["meta_info"]["finish_reason"] is None for e in objs[:-1])
        else:
            check_decode_body(d.body, w)
    assert sum(1 for r in reqs if r.decode.events) == len(prompts)
    stats = decode.wait_pools_full()["role"]["transfer"]
    prefill.wait_pools_full()
    assert stats["rooms_succeeded"] - before == len(reqs)
    assert stats["bytes_received"] > 0
    # Per-node metrics: queue length per PD stage, transfer bytes and latency histogram.
    pm, dm = prefill.metrics(), decode.metrics()
    for stage in ("bootstrap", "inflight"):
        assert pm[f'pdserve_pd_queue_length{{stage="{stage}"}}'] == 0, pm
    for stage in ("prealloc", "transfer"):
        assert dm[f'pdserve_pd_queue_length{{stage="{stage}"}}'] == 0, dm
    assert pm["pdserve_kv_transfer_bytes_sent_total"] > 0
    assert dm["pdserve_kv_transfer_bytes_received_total"] > 0
    assert pm["pdserve_kv_transfer_latency_seconds_count"] >= len(reqs)
    assert dm["pdserve_kv_transfer_latency_seconds_count"] >= len(reqs)


def test_bad_legs_are_refused_with_a_clear_error(stack):
    prefill, decode = stack.node("prefill", "tcp"), stack.node("decode", "tcp")
    other = stack.node("prefill", "mooncake")
    base = {"input_ids": random_prompt(20, seed=3100), "sampling_params": GREEDY,
            "bootstrap_room": 12345}
    cases = [
        (decode, {**base}, "prefill_node_id", 400),
        # A prefill node that is not (or no longer) live: 503, so the router retries.
        (decode, {**base, "prefill_node_id": "no-such-node"}, "no live prefill node", 503),
        (decode, {**base, "prefill_node_id": decode.node_id}, "no live prefill node", 503),
        (decode, {**base, "prefill_node_id": other.node_id}, "transfer_backend", 400),
        (prefill, {k: v for k, v in base.items() if k != "bootstrap_room"}, "bootstrap_room",
         400),
        (prefill, {**base, "bootstrap_room": -1}, "bootstrap_room", 400),
    ]
    for node, body, needle, status in cases:
        r = httpx.post(f"{node.url}/generate", json=body, timeout=30)
        assert r.status_code == status, (node.name, body.keys(), r.status_code, r.text)
        err = r.json()["error"]
        assert needle.lower() in err["message"].lower(), (needle, err)
    decode.wait_pools_full()
    prefill.wait_pools_full()


def test_decode_leg_ends_when_its_client_leaves_before_the_kv(stack):
    """A decode leg still waiting for its KV (its prefill never got the other leg) whose
    client gives up, as the router does at its request timeout: the decode node ends it
    when the connection closes, streaming or not, instead of holding the request, its
    pages and its room until the bootstrap timeout (300 s on this pair)."""
    patient = ["--kv-bootstrap-timeout-s", "300"]
    prefill = Node("prefill", "tcp", stack.registry, stack.log_dir, MODEL,
                   [*PREFILL_FLAGS, *patient])
    decode = Node("decode", "tcp", stack.registry, stack.log_dir, MODEL,
                  [*DECODE_FLAGS, *patient])
    try:
        for node in (prefill, decode):
            node.spawn()
        for node in (prefill, decode):
            node.wait_ready()
        for i, stream in enumerate((True, False)):
            body = {"input_ids": random_prompt(30, seed=3200 + i), "sampling_params": GREEDY,
                    "bootstrap_room": 77_000 + i, "prefill_node_id": prefill.node_id,
                    "stream": stream}
            with pytest.raises(httpx.ReadTimeout):  # no KV, no answer: the client leaves
                httpx.post(f"{decode.url}/generate", json=body, timeout=3)
            decode.wait_pools_full(timeout=30)
            prefill.wait_pools_full(timeout=30)
        assert decode.metrics()['pdserve_requests_total{finish_reason="abort"}'] >= 2
    finally:
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_kill9_prefill_mid_transfer(stack, backend):
    prefill, decode = stack.node("prefill", backend), stack.node("decode", backend)
    failed_before = decode.fresh_stats()["role"]["transfer"]["rooms_failed"]
    prompts = [random_prompt(1800, seed=3200 + i) for i in range(8)]
    reqs = [PDRequest(prefill, decode, p, GREEDY).start() for p in prompts]
    # Wait until the decode has pre-allocated and is waiting for KV (transfer queue).
    deadline = time.monotonic() + 60
    while decode.stats().get("role", {}).get("transfer_queue", 0) < 1:
        assert time.monotonic() < deadline, decode.info()
        time.sleep(0.05)
    prefill.kill9()
    t_kill = time.monotonic()
    for r in reqs:
        r.join(KILL_BOUND_S + 30)
    done_ok = [r for r in reqs if r.decode.status == 200]
    failed = [r for r in reqs if r.decode.status != 200]
    assert failed, "every request finished before the kill: nothing was mid-transfer"
    for r in failed:
        d = r.decode
        assert d.error is None, f"decode leg transport error: {d.error}"
        assert d.status in (500, 503), (d.status, d.body)
        msg = d.body["error"]["message"]
        assert msg and isinstance(msg, str), d.body
        assert d.t_end - t_kill < KILL_BOUND_S, \
            f"decode leg failed {d.t_end - t_kill:.1f}s after the kill ({msg})"
    want = colocated_greedy(MODEL, [prompts[reqs.index(r)] for r in done_ok],
                            GREEDY["max_new_tokens"])
    for r, w in zip(done_ok, want, strict=True):
        check_decode_body(r.decode.body, w)
    stats = decode.wait_pools_full(timeout=10)
    assert stats["role"]["transfer"]["rooms_failed"] > failed_before
    assert decode.metrics()["pdserve_kv_transfer_rooms_failed_total"] > failed_before
    assert decode.alive and decode.info()["stats"] is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_kill9_decode_mid_transfer(stack, backend):
    """kill -9 of the decode node while the prefill node is writing its KV: every
    unfinished prefill leg ends with a clear error within the heartbeat bound, and the
    prefill node's KV pages, request slots, metadata rows and transfer rooms all come
    back."""
    prefill, decode = stack.node("prefill", backend), stack.node("decode", backend)
    prompts = [random_prompt(1800, seed=5200 + i) for i in range(12)]
    reqs = [PDRequest(prefill, decode, p, GREEDY).start() for p in prompts]
    # Wait until the decode has pre-allocated and waits for KV (its transfer queue): the
    # prefill node is computing and sending those requests' pages.
    deadline = time.monotonic() + 90
    while decode.stats().get("role", {}).get("transfer_queue", 0) < 1:
        assert time.monotonic() < deadline, (decode.info(), [
            (r.results.get("prefill"), r.results.get("decode")) for r in reqs])
        time.sleep(0.02)
    decode.kill9()
    t_kill = time.monotonic()
    for r in reqs:
        r.join(KILL_BOUND_S + 30)
    failed = [r for r in reqs if r.prefill.status != 200]
    assert failed, "every prefill leg finished before the kill: nothing was mid-transfer"
    for r in failed:
        p = r.prefill
        assert p.error is None, f"prefill leg transport error: {p.error}"
        assert p.status in (500, 503), (p.status, p.body)
        assert p.body["error"]["message"], p.body
        assert p.t_end - t_kill < KILL_BOUND_S, f"prefill leg failed {p.t_end - t_kill:.1f}s " \
                                                 "after the kill"
    stats = prefill.wait_pools_full(timeout=20)
    role = stats["role"]
    assert role["free_metadata_slots"] == role["total_metadata_slots"], role
    assert role["transfer"]["live_rooms"] == 0 and role["transfer"]["rooms_failed"] > 0
    assert prefill.alive
