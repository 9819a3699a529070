"""The same greedy tokens whatever the scheduling: loop, chunking, page size, prefix cache,
policy, batch limits and retraction must not change a single token."""

from __future__ import annotations

import functools

import pytest
from engine_helpers import (
    TINY_MODELS,
    TINY_NEW_TOKENS,
    TINY_PROMPTS,
    baseline_greedy,
    get_llm,
    greedy,
    random_prompt,
    run_bounded,
    run_ids,
)

from pdserve import SamplingParams

VARIANTS = {
    "normal-loop": dict(disable_overlap=True),
    "chunked-64": dict(chunked_prefill_size=64),
    "chunked-64-normal": dict(chunked_prefill_size=64, disable_overlap=True),
    "chunked-64-budget-96": dict(chunked_prefill_size=64, max_prefill_tokens=96),
    "page-1": dict(page_size=1),
    "no-prefix-cache": dict(disable_prefix_cache=True),
    "lpm-3-running": dict(schedule_policy="lpm", max_running_requests=3),
    "1-running": dict(max_running_requests=1),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("model", TINY_MODELS)
def test_variant_gives_same_tokens(model, variant):
    assert max(len(p) for p in TINY_PROMPTS) > 64  # chunking really happens
    llm = get_llm(model, **VARIANTS[variant])
    outs = run_ids(llm, TINY_PROMPTS, greedy(TINY_NEW_TOKENS, ignore_eos=True))
    base = baseline_greedy(model)
    for i, (out, ref) in enumerate(zip(outs, base, strict=True)):
        assert out == list(ref), f"prompt {i} ({len(TINY_PROMPTS[i])} tokens)"


def test_string_and_token_prompts_agree():
    llm = get_llm("tiny-llama")
    text = "The quick brown fox jumps over the lazy dog"
    ids = llm.encode(text)
    a, b = llm.generate([text, ids], greedy(8))
    assert a.output_ids == b.output_ids
    (single,) = llm.generate(text, greedy(8))  # a bare string is one prompt
    assert single.output_ids == a.output_ids
    (single_ids,) = llm.generate(ids, greedy(8))  # so is a bare token-id list
    assert single_ids.output_ids == a.output_ids


# -- prefix cache ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", TINY_MODELS)
def test_prefix_cache_hit_equals_cold(model):
    llm = get_llm(model)
    params = greedy(TINY_NEW_TOKENS, ignore_eos=True)
    prompts = [list(p) for p in TINY_PROMPTS]
    llm.engine.kv.cache.reset()
    cold = llm.generate(prompts, params)
    warm = llm.generate(prompts, params)
    assert [o.output_ids for o in warm] == [o.output_ids for o in cold]
    assert [o.output_ids for o in cold] == [list(o) for o in baseline_greedy(model)]
    ps = llm.config.page_size
    for p, c, w in zip(prompts, cold, warm, strict=True):
        assert c.cached_tokens == 0
        # Every whole page before the prompt's last token is reused: that token is always
        # computed, its logits give the first output.
        assert w.cached_tokens == (len(p) - 1) // ps * ps, f"prompt of {len(p)} tokens"
        assert w.cached_tokens % ps == 0
    assert sum(w.cached_tokens for w in warm) > 0


def test_prefix_cache_extends_into_outputs():
    """A request that continues a finished one (prompt + its outputs) hits the cache for
    the outputs' pages too, and gives the tokens a cold engine gives."""
    llm = get_llm("tiny-llama")
    cold_llm = get_llm("tiny-llama", disable_prefix_cache=True)
    prompt = random_prompt(40, seed=7)
    (first,) = llm.generate([prompt], greedy(30, ignore_eos=True))
    follow = prompt + first.output_ids + random_prompt(5, seed=8)
    (warm,) = llm.generate([follow], greedy(16, ignore_eos=True))
    (cold,) = cold_llm.generate([follow], greedy(16, ignore_eos=True))
    assert warm.output_ids == cold.output_ids
    assert warm.cached_tokens >= (len(prompt) + 29) // 16 * 16 > len(prompt)
    assert cold.cached_tokens == 0


@pytest.mark.parametrize("page_size", [16, 1])
def test_shared_long_prefix(page_size):
    """Many prompts sharing a 150-token prefix: after one of them ran, the others reuse its
    pages and still give the cold engine's tokens."""
    llm = get_llm("tiny-llama", page_size=page_size, chunked_prefill_size=64)
    cold_llm = get_llm("tiny-llama", disable_prefix_cache=True)
    prefix = random_prompt(150, seed=42)
    prompts = [prefix + random_prompt(n, seed=50 + n) for n in (1, 5, 16, 17, 33, 70)]
    params = greedy(20, ignore_eos=True)
    cold = cold_llm.generate(prompts, params)
    llm.generate([prefix + [123]], greedy(2))  # warm the cache with the prefix
    warm = llm.generate(prompts, params)
    assert [o.output_ids for o in warm] == [o.output_ids for o in cold]
    for o in warm:
        assert o.cached_tokens >= 150 // page_size * page_size
    stats = llm.engine.memory_stats()
    assert stats["cached_pages"] > 0
    assert llm.engine.kv.cache.hit_tokens > 0


def test_lpm_prefers_cached_prefix_and_agrees():
    llm = get_llm("tiny-llama", schedule_policy="lpm", max_running_requests=2)
    cold_llm = get_llm("tiny-llama", disable_prefix_cache=True)
    prefix = random_prompt(96, seed=3)
    llm.generate([prefix + [77]], greedy(1))
    prompts = [random_prompt(90, seed=100 + i) for i in range(3)]
    prompts += [prefix + random_prompt(8, seed=200 + i) for i in range(3)]
    params = greedy(12, ignore_eos=True)
    warm = llm.generate(prompts, params)
    cold = cold_llm.generate(prompts, params)
    assert [o.output_ids for o in warm] == [o.output_ids for o in cold]
    assert all(o.cached_tokens >= 96 for o in warm[3:])


# -- retraction -----------------------------------------------------------------------------

# 64 pages of 4 tokens and no decode reservation: admission over-commits, decode runs out.
TINY_POOL = dict(page_size=4, max_total_tokens=256, decode_reserve_tokens=0)
RETRACT_PROMPTS = [random_prompt(10 + 3 * i, seed=300 + i) for i in range(10)]


def _retract_params() -> list[SamplingParams]:
    params = [greedy(48, ignore_eos=True) for _ in RETRACT_PROMPTS]
    # Seeded sampled requests must also come through a retraction unchanged.
    params[1] = SamplingParams(max_new_tokens=48, temperature=1.0, seed=11, ignore_eos=True)
    params[6] = SamplingParams(max_new_tokens=48, temperature=0.8, top_p=0.9, top_k=50,
                               seed=12, ignore_eos=True)
    return params


@functools.cache
def _roomy_reference(model: str) -> list[list[int]]:
    return run_ids(get_llm(model), RETRACT_PROMPTS, _retract_params())


TIGHT = {
    "overlap": TINY_POOL,
    "normal": dict(TINY_POOL, disable_overlap=True),
    "page-1": dict(page_size=1, max_total_tokens=160, decode_reserve_tokens=0),
}


@pytest.mark.parametrize("tight_cfg", list(TIGHT))
@pytest.mark.parametrize("model", TINY_MODELS)
def test_retraction_gives_same_tokens(model, tight_cfg):
    ref = _roomy_reference(model)
    tight = get_llm(model, **TIGHT[tight_cfg])
    need = sum(len(p) + 48 for p in RETRACT_PROMPTS)
    assert need > 2 * tight.engine.max_total_tokens  # cannot all fit at once
    before = tight.engine.sched.num_retractions
    outs = run_bounded(tight, RETRACT_PROMPTS, _retract_params())
    assert tight.engine.sched.num_retractions > before
    assert all(o.finish_reason == "length" and len(o.output_ids) == 48 for o in outs)
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert o.output_ids == r, f"request {i}"


def test_retraction_without_prefix_cache():
    ref = _roomy_reference("tiny-llama")
    tight = get_llm("tiny-llama", disable_prefix_cache=True, **TINY_POOL)
    before = tight.engine.sched.num_retractions
    outs = run_bounded(tight, RETRACT_PROMPTS, _retract_params())
    assert tight.engine.sched.num_retractions > before
    assert [o.output_ids for o in outs] == ref


# Long prompts prefilled in chunks on a pool that holds each request alone but not all of
# them at once: admitting every prompt's first chunks must not leave the pool full of
# half-prefilled requests that can neither finish their prefill nor be retracted.
CHUNK_POOLS = {
    "default-reserve-overlap": (
        dict(page_size=16, max_total_tokens=512, chunked_prefill_size=64),
        [random_prompt(300, seed=400 + i) for i in range(4)], 16),
    "default-reserve-normal": (
        dict(page_size=16, max_total_tokens=512, chunked_prefill_size=64, disable_overlap=True),
        [random_prompt(300, seed=400 + i) for i in range(4)], 16),
    "no-reserve-page-4": (
        dict(page_size=4, max_total_tokens=256, chunked_prefill_size=32, decode_reserve_tokens=0),
        [random_prompt(150 - 20 * i, seed=410 + i) for i in range(5)], 40),
    "2-running-normal": (
        dict(page_size=4, max_total_tokens=256, chunked_prefill_size=32, max_running_requests=2,
             disable_overlap=True),
        [random_prompt(150 - 20 * i, seed=420 + i) for i in range(3)], 40),
}


@pytest.mark.parametrize("case", list(CHUNK_POOLS))
def test_chunked_prefill_on_a_tight_pool_completes(case):
    cfg, prompts, n = CHUNK_POOLS[case]
    llm = get_llm("tiny-llama", **cfg)
    for p in prompts:  # every request fits the pool on its own
        assert len(p) + n <= llm.engine.max_total_tokens
    ref = run_ids(get_llm("tiny-llama"), prompts, greedy(n, ignore_eos=True))
    reqs = run_bounded(llm, prompts, greedy(n, ignore_eos=True), max_steps=1000)
    assert [r.output_ids for r in reqs] == ref
    assert all(r.finish_reason == "length" for r in reqs)
