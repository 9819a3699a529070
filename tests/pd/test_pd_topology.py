"""Topologies 1P2D and 2P1D in process, token-exact, on both backends; and the handshake's
compatibility check (a peer whose KV cannot land in our pool fails fast and clearly)."""

from __future__ import annotations

import pytest
from pd_pair import BACKENDS, PDCluster, assert_failed, colocated_greedy, greedy, random_prompt

MODEL = "tiny-llama"
N = 12
PROMPTS = [random_prompt(n, seed=1300 + i) for i, n in enumerate((5, 17, 33, 64, 70, 100,
                                                                   129, 150))]
SHARED = [PROMPTS[-1][:40] + random_prompt(k, seed=1400 + k) for k in (8, 60)]


def check_exact(legs, prompts, what: str) -> None:
    want = colocated_greedy(MODEL, prompts, N)
    got = [leg.output_ids for leg in legs]
    bad = [(len(p), g, w) for p, g, w in zip(prompts, got, want, strict=True) if g != w]
    assert not bad, f"{what}: PD != colocated (prompt len, PD, colocated): {bad}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_prefill_two_decodes(backend):
    cluster = PDCluster(MODEL, backend, prefills=[{"chunked_prefill_size": 64}],
                        decodes=[{}, {"disable_overlap": True, "page_size": 16}])
    try:
        prompts = PROMPTS + SHARED
        d = [i % 2 for i in range(len(prompts))]
        legs = cluster.generate(prompts, greedy(N), d=d)
        check_exact(legs, prompts, "1P2D alternating decodes")
        for j in (0, 1):
            assert cluster.decodes[j].role.mgr.metrics()["rooms_succeeded"] == d.count(j)
        cluster.assert_pools_full()

        # The prefill now caches every prompt, decode 1 has only its own half: the other
        # half's cached pages go out early and really travel to decode 1.
        cluster.reset_caches("d")
        early = cluster.prefills[0].role.early_sent_pages
        before = cluster.decodes[1].role.mgr.metrics()["bytes_received"]
        legs = cluster.generate(prompts, greedy(N), d=1)
        check_exact(legs, prompts, "1P2D, all to the cold decode")
        assert cluster.prefills[0].role.early_sent_pages > early
        assert cluster.decodes[1].role.mgr.metrics()["bytes_received"] > before
        cluster.assert_pools_full()
    finally:
        cluster.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_prefills_one_decode(backend):
    cluster = PDCluster(MODEL, backend,
                        prefills=[{"chunked_prefill_size": 64},
                                  {"chunked_prefill_size": 0, "disable_overlap": True}],
                        decodes=[{}])
    try:
        prompts = PROMPTS + SHARED
        p = [i % 2 for i in range(len(prompts))]
        legs = cluster.generate(prompts, greedy(N), p=p)
        check_exact(legs, prompts, "2P1D alternating prefills")
        for j in (0, 1):
            assert cluster.prefills[j].role.mgr.metrics()["rooms_succeeded"] == p.count(j)
        cluster.assert_pools_full()
        # The same prompts at once through both prefills (distinct rooms on one decode).
        legs = cluster.generate(prompts + prompts, greedy(N),
                                p=[0] * len(prompts) + [1] * len(prompts))
        check_exact(legs, prompts + prompts, "2P1D, every prompt through both prefills")
        cluster.assert_pools_full()
    finally:
        cluster.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_incompatible_page_size_fails_both_legs_fast(backend):
    cluster = PDCluster(MODEL, backend, prefills=[{"page_size": 16}],
                        decodes=[{"page_size": 8}])
    try:
        leg = cluster.submit(PROMPTS[3], greedy(N))
        cluster.run(timeout=10)  # far below any timeout: the handshake itself refuses
        assert_failed(leg.decode, "decode leg")
        # The prefill started early: its forward may finish (finish reason "length")
        # before the decode's request is refused; the error is what its leg answers (503).
        assert leg.prefill.error, (leg.prefill.finish_reason, leg.prefill.error)
        assert "page" in (leg.decode.error + leg.prefill.error).lower(), \
            (leg.decode.error, leg.prefill.error)
        cluster.assert_pools_full()
    finally:
        cluster.close()


def test_first_token_from_the_prefill_can_end_the_request():
    """max_new_tokens=1, or a stop token equal to the first token: the decode leg ends at
    commit time with the prefill's token and never decodes."""
    cluster = PDCluster(MODEL, "tcp")
    try:
        first = colocated_greedy(MODEL, PROMPTS[:3], N)
        legs = cluster.generate(PROMPTS[:3], greedy(1))
        assert [leg.output_ids for leg in legs] == [w[:1] for w in first]
        assert all(leg.decode.finish_reason == "length" for leg in legs)
        legs = [cluster.submit(p, greedy(N, stop_token_ids=[w[0]]))
                for p, w in zip(PROMPTS[:3], first, strict=True)]
        cluster.run(timeout=20)
        for leg, w in zip(legs, first, strict=True):
            assert leg.decode.error is None and leg.decode.finish_reason == "stop"
            assert leg.output_ids == w[:1]
        assert cluster.decodes[0].out.generated_tokens == 0  # nothing was decoded
        cluster.assert_pools_full()
    finally:
        cluster.close()
