"""Logprobs equal transformers' log-softmax of the same sequence's logits (fp32, 1e-4), for
sampled and prompt tokens, under both loops, chunked prefill, prefix cache and retraction
(docs/architecture.md: Logprobs)."""

from __future__ import annotations

import functools

import pytest
import torch
from engine_helpers import (
    TINY_MODELS,
    get_llm,
    hf_model,
    random_prompt,
)

from pdserve import SamplingParams

TOL = 1e-4
SMOLLM = "smollm2-135m"


@pytest.fixture(scope="module", autouse=True)
def _free_logprobs_after_module():
    # [len, V] fp32 rows; tests/conftest.py frees the models themselves.
    yield
    hf_logprobs.cache_clear()


@functools.cache
def hf_logprobs(model: str, seq: tuple[int, ...]) -> torch.Tensor:
    """[len(seq), V]: log-softmax of transformers' fp32 logits at each position."""
    with torch.no_grad():
        logits = hf_model(model)(torch.tensor([seq])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_entry(entry, ref_row: torch.Tensor, token: int, k: int) -> None:
    lp, top = entry
    assert abs(lp - ref_row[token].item()) < TOL
    assert len(top) == k
    ref_top = ref_row.topk(k)
    for (tid, tlp), rlp in zip(top, ref_top.values.tolist(), strict=True):
        assert abs(tlp - rlp) < TOL
        assert abs(ref_row[tid].item() - tlp) < TOL  # the id is one with that logprob
    if k:
        assert top[0][1] >= lp - TOL  # the best alternative is at least the sampled one


def check_output(model: str, out, k: int, pk: int | None) -> None:
    seq = tuple(out.prompt_ids + out.output_ids)
    ref = hf_logprobs(model, seq)
    n = len(out.prompt_ids)
    assert len(out.logprobs) == len(out.output_ids)
    for j, (tok, entry) in enumerate(zip(out.output_ids, out.logprobs, strict=True)):
        check_entry(entry, ref[n - 1 + j], tok, k)
    if pk is None:
        assert out.prompt_logprobs is None
        return
    assert len(out.prompt_logprobs) == n - 1
    for i, entry in enumerate(out.prompt_logprobs):
        check_entry(entry, ref[i], out.prompt_ids[i + 1], pk)


PROMPTS = [random_prompt(n, seed=4000 + n) for n in (1, 5, 17, 40, 70)]


@pytest.mark.parametrize("model", TINY_MODELS)
@pytest.mark.parametrize("loop", ["overlap", "normal"])
def test_tiny_logprobs_match_transformers(model, loop):
    llm = get_llm(model, loop=loop, chunked_prefill_size=32)
    params = [SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3,
                             prompt_logprobs=2),
              SamplingParams(max_new_tokens=8, temperature=0.9, seed=7, ignore_eos=True,
                             logprobs=0),
              SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
              SamplingParams(max_new_tokens=8, temperature=1.0, top_k=5, seed=3,
                             ignore_eos=True, logprobs=20, prompt_logprobs=0),
              SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)]
    outs = llm.generate(PROMPTS, params)
    for out, p in zip(outs, params, strict=True):
        if p.logprobs is None:
            assert out.logprobs is None and out.prompt_logprobs is None
            continue
        check_output(model, out, p.logprobs, p.prompt_logprobs)


def test_logprobs_do_not_change_outputs():
    """Asking for logprobs changes no token: greedy and seeded samples are the same."""
    llm = get_llm("tiny-llama")
    plain = [SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True),
             SamplingParams(max_new_tokens=10, temperature=0.8, seed=11, ignore_eos=True)]
    with_lp = [SamplingParams(**{**vars(p), "logprobs": 5, "prompt_logprobs": 1})
               for p in plain]
    a = llm.generate(PROMPTS[2:4], plain)
    b = llm.generate(PROMPTS[2:4], with_lp)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]


def test_prompt_logprobs_ignore_the_prefix_cache():
    """A cached prefix is recomputed when prompt logprobs are asked: every position counts."""
    llm = get_llm("tiny-llama", page_size=4)
    prompt = random_prompt(30, seed=77)
    llm.generate([prompt], SamplingParams(max_new_tokens=2, temperature=0.0))  # now cached
    p = SamplingParams(max_new_tokens=3, temperature=0.0, prompt_logprobs=1, logprobs=1)
    out = llm.generate([prompt], p)[0]
    assert out.cached_tokens == 0
    check_output("tiny-llama", out, 1, 1)
    again = llm.generate([prompt], SamplingParams(max_new_tokens=2, temperature=0.0))[0]
    assert again.cached_tokens > 0  # without prompt logprobs the cache is used again


def test_logprobs_survive_retraction():
    llm = get_llm("tiny-llama", page_size=4, max_total_tokens=256, decode_reserve_tokens=0)
    prompts = [random_prompt(10 + 3 * i, seed=800 + i) for i in range(8)]
    p = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2,
                       prompt_logprobs=1)
    before = llm.engine.sched.num_retractions
    outs = llm.generate(prompts, p)
    assert llm.engine.sched.num_retractions > before
    for out in outs:
        check_output("tiny-llama", out, 2, 1)


@pytest.mark.parametrize("bad", [-1, 21, 2.5, True])
def test_logprobs_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad).validate()
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad).validate()


def test_smollm2_logprobs_match_transformers():
    llm = get_llm(SMOLLM)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = [SamplingParams(max_new_tokens=10, temperature=0.0, logprobs=5, prompt_logprobs=5),
              SamplingParams(max_new_tokens=10, temperature=0.7, seed=1, logprobs=20)]
    for out, p in zip(llm.generate(prompts, params), params, strict=True):
        check_output(SMOLLM, out, p.logprobs, p.prompt_logprobs)


@pytest.mark.parametrize(("loop", "hicache"), [("overlap", False), ("normal", False),
                                              ("overlap", True)])
def test_cache_prompt_shares_the_prompt_with_later_choices(loop, hicache):
    """n > 1: choice 0 puts its prompt pages into the cache once computed (while it keeps
    running); choices sent after its first token reuse them and sample the same. With
    HiCache on too (its tree inserts through insert_dups)."""
    llm = get_llm("tiny-llama", loop=loop, page_size=4, enable_hierarchical_cache=hicache)
    eng = llm.engine
    prompt = random_prompt(37, seed=4242)  # 9 whole pages and one partial
    p = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    first = eng.add_request("choice-0", prompt, SamplingParams(**{**vars(p),
                                                                  "cache_prompt": True}))
    while not first.output_ids:
        eng.step()
    assert first.cached_len == 36 and not first.finished  # its prompt pages are shared now
    rest = [eng.add_request(f"choice-{i}", prompt, SamplingParams(**vars(p))) for i in (1, 2)]
    while eng.has_work():
        eng.step()
    eng.loop.drain()
    assert [r.cached_tokens for r in rest] == [36, 36]
    assert rest[0].output_ids == rest[1].output_ids == first.output_ids
    assert all(abs(a[0] - b[0]) < TOL for a, b in zip(
        rest[0].output_logprobs, first.output_logprobs, strict=True))
