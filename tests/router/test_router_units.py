"""The router's parts in isolation (no processes): circuit breaker, bounded queue, node
choice, the decode stream reader, config and CLI."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from bootstrap.pairing import pairing_problem
from bootstrap.record import RegisteredNode
from pdserve.cli import build_parser
from pdserve.http.errors import ApiError
from pdserve.router.admission import Admission
from pdserve.router.breaker import CircuitBreaker
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.router.events import DONE, StreamFormatError, parse_line, to_event
from pdserve.router.nodes import NodeState, NodeTable
from pdserve.router.picker import order_decode, order_prefill, prefix_key

PAGE = 16


def record(node_id: str, role: str, running: int = 0, instance: str = "i1",
           model: str = "tiny-llama", page_size: int = PAGE, kv_usage: float = 0.0,
           heads: int = 2) -> RegisteredNode:
    now = time.time()
    return RegisteredNode.model_validate({
        "node_id": node_id, "instance_id": instance, "role": role,
        "http_url": f"http://127.0.0.1:1/{node_id}", "kv_endpoint": "127.0.0.1:2",
        "transfer_backend": "tcp", "model": model, "page_size": page_size,
        "kv_layout": {"num_layers": 4, "num_kv_heads": heads, "head_dim": 16,
                      "dtype": "float32"},
        "load": {"running": running, "waiting": 0, "kv_usage": kv_usage}, "ttl_s": 10.0,
        "registered_at": now, "renewed_at": now, "expires_at": now + 10, "generation": 1})


def state(node_id: str, role: str = "prefill", **kw) -> NodeState:
    return NodeState(record(node_id, role, **kw), CircuitBreaker(3, 1.0, 8.0))


# -- circuit breaker ----------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_breaker_opens_after_consecutive_failures_and_probes_once():
    clock = Clock()
    b = CircuitBreaker(3, 1.0, 8.0, clock)
    b.failure()
    b.failure()
    b.success()  # resets the streak
    b.failure()
    b.failure()
    assert b.available() and b.state == "closed"
    b.failure()
    assert not b.available() and b.state == "open"
    clock.t += 1.01
    assert b.state == "half_open" and b.available()
    b.acquire()  # the one trial
    assert not b.available()
    b.failure()  # failed trial: open again for twice as long
    clock.t += 1.5
    assert not b.available()
    clock.t += 0.6
    assert b.available()
    b.acquire()
    b.success()
    assert b.state == "closed" and b.available()


def test_breaker_refused_connection_opens_at_once_and_cooldown_is_capped():
    clock = Clock()
    b = CircuitBreaker(3, 1.0, 4.0, clock)
    for _ in range(10):
        b.failure(hard=True)
    assert b.state == "open"
    clock.t += 4.01
    assert b.available()


def test_breaker_trial_that_never_reports_stops_blocking():
    clock = Clock()
    b = CircuitBreaker(1, 1.0, 8.0, clock)
    b.failure()
    clock.t += 1.01
    b.acquire()  # its request was cancelled: no success, no failure
    assert not b.available()
    clock.t += 1.01
    assert b.available()


# -- bounded queue ------------------------------------------------------------------------
def test_admission_full_queue_429_timeout_408_fifo_handoff():
    async def main():
        adm = Admission(max_running=1, max_queued=2, timeout_s=2.0)  # b times out
        await adm.acquire()
        order: list[str] = []

        async def waiter(name: str):
            await adm.acquire()
            order.append(name)

        a = asyncio.create_task(waiter("a"))
        await asyncio.sleep(0.01)
        b = asyncio.create_task(waiter("b"))
        await asyncio.sleep(0.01)
        with pytest.raises(ApiError) as full:
            await adm.acquire()
        assert full.value.status == 429
        adm.release()  # the slot goes to "a", not to a newcomer
        await asyncio.sleep(0.01)
        assert order == ["a"] and adm.running == 1
        with pytest.raises(ApiError) as late:
            await b
        assert late.value.status == 408 and adm.waiting == 0
        adm.release()
        assert adm.running == 0
        await a

    asyncio.run(main())


def test_admission_cancelled_waiter_gives_its_place_back():
    async def main():
        adm = Admission(max_running=1, max_queued=4, timeout_s=5)
        await adm.acquire()
        t = asyncio.create_task(adm.acquire())
        while adm.waiting == 0:  # queued
            await asyncio.sleep(0.001)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t  # however long the cancellation takes on a loaded machine
        assert adm.waiting == 0
        adm.release()
        assert adm.running == 0

    asyncio.run(main())


# -- node choice --------------------------------------------------------------------------
def test_prefix_key_uses_whole_leading_pages_only():
    ids = list(range(40))
    assert prefix_key(ids[:15], PAGE, 2) is None
    assert prefix_key(ids[:20], PAGE, 2) == prefix_key(ids[:16] + [999] * 5, PAGE, 2)
    assert prefix_key(ids, PAGE, 2) == prefix_key(ids[:32] + [7, 7], PAGE, 2)
    assert prefix_key(ids, PAGE, 2) != prefix_key(ids[:31] + [0], PAGE, 2)
    assert prefix_key(ids, PAGE, 0) is None


def test_prefill_choice_follows_the_prefix_and_spreads_prefixes():
    rng = random.Random(0)
    nodes = [state(f"p{i}") for i in range(4)]
    chosen = set()
    for k in range(64):
        prompt = [k] * 32 + list(range(10))
        first = order_prefill(nodes, prompt, 2, 4, 1.5, rng)[0]
        again = order_prefill(nodes, prompt[:32] + [5] * 20, 2, 4, 1.5, rng)[0]
        assert first is again  # same leading pages, same node
        chosen.add(first.node_id)
    assert chosen == {"p0", "p1", "p2", "p3"}


def test_prefill_node_joining_moves_only_its_share_of_prefixes():
    rng = random.Random(0)
    three = [state(f"p{i}") for i in range(3)]
    four = [*three, state("p3")]
    prompts = [[k] * 32 for k in range(300)]
    before = [order_prefill(three, p, 2, 4, 1.5, rng)[0].node_id for p in prompts]
    after = [order_prefill(four, p, 2, 4, 1.5, rng)[0].node_id for p in prompts]
    moved = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert all(b == "p3" for _, b in moved)  # keys only move to the new node
    assert 40 < len(moved) < 120  # about a quarter


def test_prefill_affinity_yields_to_load():
    rng = random.Random(0)
    nodes = [state("p0"), state("p1")]
    prompt = [3] * 32
    preferred = order_prefill(nodes, prompt, 2, 4, 1.5, rng)[0]
    other = nodes[1] if preferred is nodes[0] else nodes[0]
    preferred.inflight = 4  # within the absolute gap: affinity holds
    assert order_prefill(nodes, prompt, 2, 4, 1.5, rng)[0] is preferred
    preferred.inflight = 6
    assert order_prefill(nodes, prompt, 2, 4, 1.5, rng)[0] is other
    other.inflight = 5  # 6 vs 5: not 1.5x busier, affinity again
    assert order_prefill(nodes, prompt, 2, 4, 1.5, rng)[0] is preferred
    short = order_prefill(nodes, [1, 2, 3], 2, 4, 1.5, rng)  # no full page: load only
    assert short[0] is other


def test_decode_choice_least_loaded_among_matching_layouts():
    rng = random.Random(0)
    p = state("p0")
    d = [state("d0", "decode", running=3), state("d1", "decode", running=1),
         state("d2", "decode", heads=4), state("d3", "decode", page_size=32)]
    assert [n.node_id for n in order_decode(d, p, rng)] == ["d1", "d0"]
    d[1].inflight = 5  # the router's own count beats a stale heartbeat
    assert order_decode(d, p, rng)[0].node_id == "d0"
    ties = {order_decode([state("a", "decode"), state("b", "decode")], p, rng)[0].node_id
            for _ in range(40)}
    assert ties == {"a", "b"}


def test_node_table_follows_the_registry():
    table = NodeTable(RouterConfig())
    table.update([record("p0", "prefill"), record("d0", "decode")])
    assert table.model == "tiny-llama" and table.counts() == {"prefill": 1, "decode": 1}
    p0 = table.nodes["p0"]
    p0.breaker.failure(hard=True)
    table.update([record("p0", "prefill"), record("d0", "decode"),
                  record("x", "decode", model="other")])
    assert table.nodes["p0"] is p0 and "x" not in table.nodes  # other models are ignored
    table.update([record("p0", "prefill", instance="i2")])  # restarted, d0 gone
    assert table.nodes["p0"] is not p0 and table.nodes["p0"].breaker.available()
    assert set(table.nodes) == {"p0"}


# -- decode stream ------------------------------------------------------------------------
def test_stream_events_become_deltas():
    ev1 = to_event("r", {"text": "Hel", "output_ids": [1],
                         "meta_info": {"prompt_tokens": 3, "cached_tokens": 1,
                                       "finish_reason": None}}, None)
    ev2 = to_event("r", parse_line('data: {"text": "Hello", "output_ids": [1, 2], '
                                   '"meta_info": {"id": "x", "prompt_tokens": 3, '
                                   '"finish_reason": "length"}}'), ev1)
    assert (ev1.delta, ev2.delta, ev2.finish_reason) == ("Hel", "lo", "length")
    assert ev2.generate_obj()["meta_info"]["id"] == "r"
    assert ev2.generate_obj()["meta_info"]["completion_tokens"] == 2
    assert parse_line("data: [DONE]") == DONE and parse_line("") is None
    with pytest.raises(StreamFormatError):
        parse_line("data: {nope")
    with pytest.raises(StreamFormatError):
        to_event("r", {"text": "x"}, None)


# -- config and CLI -----------------------------------------------------------------------
@pytest.mark.parametrize("flags", [["--port", "65536"], ["--registry", "nope"],
                                   ["--queue-timeout-s", "0"], ["--balance-rel-threshold", "0.5"],
                                   ["--breaker-max-cooldown-s", "0.1"],
                                   ["--stream-stall-timeout-s", "-1"]])
def test_router_config_rejects_bad_flags(flags):
    args = build_parser().parse_args(["router", *flags])
    with pytest.raises(ValueError):
        RouterConfig.from_cli(args)


def test_every_config_field_is_a_flag_with_help():
    parser = build_parser()
    helps = {}
    for action in parser._subparsers._group_actions[0].choices["router"]._actions:
        helps.update({opt: action.help for opt in action.option_strings})
    from dataclasses import fields

    from pdserve.http.limits import HttpLimits

    for f in [*fields(RouterConfig), *fields(HttpLimits)]:
        if f.name == "http":  # the sub-config: its fields are the flags
            continue
        flag = "--" + f.name.replace("_", "-")
        assert helps.get(flag), flag
    cfg = RouterConfig.from_cli(parser.parse_args(["router"]))
    assert cfg == RouterConfig()


def test_node_answers_are_classified():
    import httpx

    from pdserve.router.legs import inband_error, status_error, transport_error

    p, d = state("p0"), state("d0", "decode")

    def answer(status: int, message: str, code=None) -> httpx.Response:
        return httpx.Response(status, json={"error": {"message": message, "code": code}})

    too_long = status_error(d, "decode", answer(400, "prompt too long", "context"), p)
    assert (too_long.status, too_long.retryable, too_long.node) == (400, False, d)
    gone = status_error(d, "decode", answer(400, "no live prefill node 'p0' in the registry"), p)
    assert gone.retryable and gone.node is p and gone.status == 503
    busy = status_error(p, "prefill", answer(429, "queue full"))
    assert busy.retryable and not busy.node_fault and busy.status == 429
    broken = status_error(p, "prefill", answer(500, "boom"))
    assert broken.node_fault and not broken.retryable and "p0" in broken.message
    refused = transport_error(p, "prefill", httpx.ConnectError("refused"))
    assert refused.retryable and refused.hard
    slow = transport_error(p, "prefill", httpx.ConnectTimeout("slow"))
    assert slow.retryable and slow.node_fault and not slow.hard
    lost = transport_error(d, "decode", httpx.ReadError("reset"))
    assert not lost.retryable and lost.node_fault and "mid-request" in lost.message
    inband = inband_error(d, {"message": "KV transfer failed", "code": 500})
    assert inband.status == 500 and "KV transfer failed" in inband.message


def test_a_draining_node_is_retried_elsewhere_and_never_picked_again():
    import httpx

    from pdserve.router.legs import status_error

    table = NodeTable(RouterConfig())
    table.update([record("p0", "prefill"), record("d0", "decode"), record("d1", "decode")])
    d0 = table.nodes["d0"]
    answer = httpx.Response(503, json={"error": {"message": "draining", "code": "draining"}})
    err = status_error(d0, "decode", answer, table.nodes["p0"])
    assert err.retryable and not err.node_fault and err.node is d0  # no breaker count
    assert d0.draining and d0.breaker.available()
    assert [n.node_id for n in table.usable("decode")] == ["d1"]
    table.update([record("p0", "prefill"), record("d0", "decode"), record("d1", "decode")])
    assert table.nodes["d0"].draining  # same instance, still registered: still skipped
    table.update([record("p0", "prefill"), record("d0", "decode", instance="i2")])
    assert not table.nodes["d0"].draining  # a new instance (restarted pod) is used again


def test_nodes_pair_across_tp_sizes_when_heads_can_be_sliced():
    def tp_state(node_id: str, role: str, tp: int, total: int = 2) -> NodeState:
        heads = total // tp if total >= tp else 1  # rank 0's share (GQA: replicated)
        rec = record(node_id, role, heads=heads).model_dump(mode="json")
        if tp > 1:  # TP1 nodes leave the fields out
            rec.update(tp_size=tp, kv_endpoints=["127.0.0.1:2"] * tp, kv_heads_total=total)
        return NodeState(RegisteredNode.model_validate(rec), CircuitBreaker(3, 1.0, 8.0))

    p1, p2 = tp_state("p1", "prefill", 1), tp_state("p2", "prefill", 2)
    d1, d2, d4 = (tp_state(f"d{t}", "decode", t) for t in (1, 2, 4))
    # KV is sliced by heads: every TP size that splits the 2 KV heads pairs with every other.
    assert all(p.pairs_with(d) for p in (p1, p2) for d in (d1, d2, d4))
    # Another KV head count cannot be sliced into ours: never paired, whatever the TP.
    other = tp_state("d3", "decode", 1, total=4)
    assert not p1.pairs_with(other) and not p2.pairs_with(other)
    assert pairing_problem(p2.as_dict(), other.as_dict()) == (
        "KV heads 2 != 4 (KV cannot be sliced between different head counts)")
    # A TP size that splits neither way (a hand-made record: nodes refuse it at start).
    bad = tp_state("d9", "decode", 1, total=2).as_dict() | {"tp_size": 3, "kv_heads_total": 2}
    assert "TP 3 cannot split 2 KV heads" in pairing_problem(p1.as_dict(), bad)
    # Equal TP sizes still compare the per-rank layout as before.
    assert not p1.pairs_with(state("d5", "decode", heads=1))


def test_router_names_why_no_decode_can_take_the_prefills_kv():
    class Watcher:
        last_error = ""

    table = NodeTable(RouterConfig())
    table.update([record("p0", "prefill"), record("d0", "decode", heads=4)])
    why = Dispatcher(RouterConfig(), table, Watcher(), None, None, None)._why_none(None)
    assert "no decode node can take a prefill node's KV (e.g. p0 -> d0: KV heads 2 != 4" in why
