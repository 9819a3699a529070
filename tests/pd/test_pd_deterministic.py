"""bfloat16 with `--enable-deterministic-inference`: a PD request's tokens equal the
colocated node's for the same prompt sent alone, on both transfer backends, although the
prefill node runs it in a chunked batch of others and the decode node decodes it beside
them (pdserve/models/batch_invariant.py); sent again with its first tokens appended, as a
router migration does, it goes on with the same tokens."""

from __future__ import annotations

import random

import pytest
from pd_pair import BACKENDS, SMOLLM, PDCluster, greedy

from pdserve import LLM

FLAGS = {"dtype": "bfloat16", "enable_deterministic_inference": True,
         "max_total_tokens": 4096}
_rng = random.Random(11)
PROMPTS = [[_rng.randrange(100, 40000) for _ in range(_rng.randrange(17, 200))]
           for _ in range(6)]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def colocated_alone() -> list[list[int]]:
    llm = LLM(SMOLLM, **FLAGS, loop="overlap", chunked_prefill_size=0)
    try:
        return [llm.generate(p, greedy(NEW_TOKENS))[0].output_ids for p in PROMPTS]
    finally:
        llm.close()


# tcp is a second run of the mechanism (the batch-invariant ops on both nodes): slow.
@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.slow) if b == "tcp" else b
                                     for b in BACKENDS])
def test_pd_bf16_equals_colocated_alone(backend, colocated_alone):
    cluster = PDCluster(SMOLLM, backend, prefills=[{**FLAGS, "chunked_prefill_size": 64}],
                        decodes=[FLAGS])
    try:
        legs = cluster.generate(PROMPTS, greedy(NEW_TOKENS))
        got = [leg.output_ids for leg in legs]
        assert got == colocated_alone
        # what a router migration sends: the prompt and the tokens out so far, as one
        # prompt to another pair; the rest of the stream must not change
        k = 5
        rest = cluster.generate([p + out[:k] for p, out in zip(PROMPTS, got, strict=True)],
                                greedy(NEW_TOKENS - k))
        assert [leg.output_ids for leg in rest] == [out[k:] for out in got]
        cluster.assert_pools_full()
    finally:
        cluster.close()
