"""PD with tensor parallelism (docs/architecture.md: Tensor parallelism): prefill TP2 ->
decode TP2 (rank to rank) and prefill TP1 <-> decode TP2 (KV sliced by heads, over both
transfer backends, GQA with replicated KV heads too) give the colocated TP1 greedy tokens
with every pool full again; a pairing that cannot be sliced is refused with a clear error;
a prefill rank killed mid-transfer fails the decode leg cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from pd_pair import (
    TINY_MODELS,
    PDCluster,
    assert_failed,
    colocated_greedy,
    engine_problems,
    greedy,
    random_prompt,
)

from bootstrap.record import RegisteredNode
from kv_transfer.heads import head_runs
from pdserve.http.errors import ApiError
from pdserve.node.registration import PrefillPeerResolver
from pdserve.pd.leg import PDLegFields

NEW_TOKENS = 12
PROMPTS = [random_prompt(n, seed=700 + i) for i, n in enumerate((1, 16, 17, 65, 150))]


@pytest.mark.parametrize("model", TINY_MODELS)
def test_pd_tp2_to_tp2_equals_colocated(model):
    cluster = PDCluster(model, "tcp", prefills=[{"tp_size": 2, "chunked_prefill_size": 64}],
                        decodes=[{"tp_size": 2}])
    try:
        fields = cluster.prefills[0].role.registry_fields()
        assert fields["tp_size"] == 2 and len(set(fields["kv_endpoints"])) == 2
        assert fields["model"] == model
        legs = cluster.generate(PROMPTS, greedy(NEW_TOKENS))
        want = colocated_greedy(model, PROMPTS, NEW_TOKENS)
        assert [leg.output_ids for leg in legs] == want
        cluster.assert_pools_full()
    finally:
        cluster.close()


HETERO = [("tiny-llama", "tcp", 1, 2), ("tiny-llama", "tcp", 2, 1),
          ("tiny-llama", "mooncake", 1, 2), ("tiny-llama", "mooncake", 2, 1),
          ("tiny-qwen2", "tcp", 1, 2), ("tiny-qwen2", "tcp", 2, 1)]  # qwen2: 1 KV head


@pytest.mark.parametrize("model,backend,p_tp,d_tp", HETERO,
                         ids=[f"{m}-{b}-P{p}D{d}" for m, b, p, d in HETERO])
def test_pd_other_tp_size_equals_colocated(model, backend, p_tp, d_tp):
    cluster = PDCluster(model, backend, prefills=[{"tp_size": p_tp, "chunked_prefill_size": 64}],
                        decodes=[{"tp_size": d_tp}], transfer={"checksum": True})
    try:
        legs = cluster.generate(PROMPTS, greedy(NEW_TOKENS))
        assert [leg.output_ids for leg in legs] == colocated_greedy(model, PROMPTS, NEW_TOKENS)
        cluster.assert_pools_full()
        # One sub-transfer per (prefill rank, decode rank) head run, seen from rank 0.
        hkv = cluster.prefills[0].loaded.hf_config.num_key_value_heads
        runs = head_runs(hkv, p_tp, d_tp)
        sent = cluster.prefills[0].role.mgr.metrics()
        got = cluster.decodes[0].role.mgr.metrics()
        assert sent["rooms_succeeded"] == len(PROMPTS) * sum(r.p_rank == 0 for r in runs)
        assert got["rooms_succeeded"] == len(PROMPTS) * sum(r.d_rank == 0 for r in runs)
        assert not got.get("checksum_failures")
    finally:
        cluster.close()


def test_unsliceable_tp_refused_with_clear_error():
    cluster = PDCluster("tiny-llama", "tcp", prefills=[{"tp_size": 2}], decodes=[{}])
    try:
        # 3 ranks cannot split tiny-llama's 2 KV heads: refused by either role at once.
        eps = [cluster.endpoint(0)] * 3
        with pytest.raises(ValueError, match="cannot be sliced for this decode node of TP 1: "
                                             "TP 3 cannot split 2 KV heads"):
            cluster.decodes[0].add_request("bad-d", list(PROMPTS[1]), greedy(4), PDLegFields(
                bootstrap_room=99, prefill_kv_endpoints=tuple(eps)))
        with pytest.raises(ValueError, match="TP 3 cannot split 2 KV heads"):
            cluster.prefills[0].add_request("bad-p", list(PROMPTS[1]), greedy(4), PDLegFields(
                bootstrap_room=99, decode_tp_size=3))
        # A TP1 decode given only rank 0's endpoint, the prefill not told its TP size (an
        # old router): the prefill's transfer handshake refuses the Register, naming the
        # TP rank it expected; both legs fail, pools full.
        room = 1234567
        dreq = cluster.decodes[0].add_request(
            "mismatch-d", list(PROMPTS[3]), greedy(4),
            PDLegFields(bootstrap_room=room, prefill_kv_endpoints=(cluster.endpoint(0),)))
        preq = cluster.prefills[0].add_request("mismatch-p", list(PROMPTS[3]), greedy(4),
                                               PDLegFields(bootstrap_room=room))
        cluster.run(timeout=60)
        assert_failed(dreq, "decode leg")
        assert "TP rank 0 of 2" in dreq.error and "TP rank 0 of 1" in dreq.error, dreq.error
        assert preq.finished
        cluster.assert_pools_full()
    finally:
        cluster.close()


def _kill_prefill_rank_mid_transfer(decode_cfg: dict, seed: int, check_decode) -> None:
    """A P TP2 node loses rank 1 (kill -9) after some pages went out but before the prompt
    (10 chunks of 16) is done. The decode node alone runs on: `check_decode(leg, decode)`
    asserts how its leg failed; its pools must be full. The prefill node is out: its next
    forward fails every request it holds."""
    cluster = PDCluster("tiny-llama", "tcp", prefills=[{"tp_size": 2, "chunked_prefill_size": 16}],
                        decodes=[decode_cfg],
                        transfer={"heartbeat_interval_s": 0.5, "heartbeat_misses": 4})
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    try:
        leg = cluster.submit(random_prompt(150, seed=seed), greedy(8))
        cluster.run(timeout=60, until=lambda: leg.prefill.pd.progress.sent_pages >= 2)
        assert not leg.prefill.finished
        victim = prefill.tp.procs[0]  # prefill rank 1
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        cluster.run(timeout=60, engines=[decode])
        assert_failed(leg.decode, "decode leg")
        check_decode(leg, decode)
        assert not engine_problems(decode), engine_problems(decode)
        with pytest.raises(RuntimeError):
            for _ in range(200):
                prefill.step()
        assert leg.prefill.finished and leg.prefill.error
    finally:
        cluster.close()


def test_prefill_rank_killed_mid_transfer_fails_decode_cleanly():
    """P TP2 -> D TP2: the decode's rank-1 room loses its peer, the room fails on every rank,
    and only then are the pages freed."""
    def check(leg, decode):
        assert "TP rank" in leg.decode.error and "prefill" in leg.decode.error, leg.decode.error

    _kill_prefill_rank_mid_transfer({"tp_size": 2}, 77, check)


def test_prefill_rank_killed_mid_transfer_fails_a_tp1_decode_cleanly():
    """P TP2 -> D TP1: the decode rank pulls its two heads from both prefill ranks (two
    sub-transfers); one prefill rank dies, its sub-transfer fails, the other is aborted,
    and the decode frees the pages only once both are terminal."""
    def check(leg, decode):
        assert "prefill" in leg.decode.error and "heartbeat" in leg.decode.error, \
            leg.decode.error
        assert decode.role.mgr.metrics()["live_rooms"] == 0  # both sub-transfers ended

    _kill_prefill_rank_mid_transfer({}, 78, check)


def _node(role: str, tp: int, kv_heads: int = 2) -> dict:
    now = time.time()
    rec = {"node_id": f"{role}-{tp}", "instance_id": "i1", "role": role,
           "http_url": "http://127.0.0.1:1", "kv_endpoint": "127.0.0.1:2",
           "transfer_backend": "tcp", "model": "tiny-llama", "page_size": 16,
           "kv_layout": {"num_layers": 4, "num_kv_heads": kv_heads // tp, "head_dim": 16,
                         "dtype": "float32"},
           "load": {"running": 0, "waiting": 0, "kv_usage": 0.0}, "ttl_s": 10.0,
           "registered_at": now, "renewed_at": now, "expires_at": now + 10, "generation": 1}
    if tp > 1:
        rec.update(tp_size=tp, kv_endpoints=[f"127.0.0.1:{2 + r}" for r in range(tp)],
                   kv_heads_total=kv_heads)
    return rec


class _Registry:
    """The registry's answer for one node id (what the decode front reads)."""

    epoch = ""
    cache_ttl_s = stale_ok_s = 0.0  # no cache: every lookup asks
    unreachable_since = None

    def __init__(self, rec: dict) -> None:
        self.rec = rec

    def get_node(self, node_id: str) -> RegisteredNode | None:
        return RegisteredNode.model_validate(self.rec) if node_id == self.rec["node_id"] \
            else None


def test_decode_front_pairs_other_tp_sizes_and_refuses_other_head_counts():
    me = _node("decode", 2)
    same = PrefillPeerResolver(_Registry(_node("prefill", 2)), me)
    leg = PDLegFields(bootstrap_room=5, prefill_node_id="prefill-2")
    assert asyncio.run(same.resolve(leg)).prefill_kv_endpoints == ("127.0.0.1:2", "127.0.0.1:3")
    # A TP1 prefill of the same model: its KV is sliced by heads for our two ranks.
    tp1 = PrefillPeerResolver(_Registry(_node("prefill", 1)), me)
    leg = PDLegFields(bootstrap_room=5, prefill_node_id="prefill-1")
    assert asyncio.run(tp1.resolve(leg)).prefill_kv_endpoints == ("127.0.0.1:2",)
    # Another KV head count cannot be sliced into ours.
    other = PrefillPeerResolver(_Registry(_node("prefill", 1, kv_heads=4)), me)
    with pytest.raises(ApiError, match="KV heads 4 != 2"):
        asyncio.run(other.resolve(leg))
