"""Sampling: seeds, batch independence, top-k / top-p / temperature (docs/architecture.md:
Interfaces)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import get_llm, greedy, hf_model, random_prompt

from pdserve import SamplingParams
from pdserve.engine.sampler import Sampler, SamplingBatch

PROMPT = random_prompt(20, seed=5)
N = 16


def sampled(seed: int | None, **kw) -> SamplingParams:
    kw.setdefault("temperature", 1.0)
    return SamplingParams(max_new_tokens=N, seed=seed, ignore_eos=True, **kw)


def test_same_seed_same_output_across_runs():
    llm = get_llm("tiny-llama")
    a = llm.generate([PROMPT], sampled(123))[0].output_ids
    llm.generate([PROMPT], sampled(None))  # the engine's own generator moves on
    b = llm.generate([PROMPT], sampled(123))[0].output_ids
    assert a == b
    assert len(a) == N


def test_seeded_output_independent_of_batch_company():
    llm = get_llm("tiny-llama")
    target = sampled(7, top_p=0.9, top_k=200)
    (alone,) = llm.generate([PROMPT], target)
    prompts = [random_prompt(70, seed=1), PROMPT, random_prompt(3, seed=2),
               random_prompt(33, seed=3), PROMPT]
    params = [sampled(8), target, sampled(None), greedy(N, ignore_eos=True),
              sampled(None, temperature=0.7)]
    outs = llm.generate(prompts, params)
    assert outs[1].output_ids == alone.output_ids
    assert outs[4].output_ids != alone.output_ids  # same prompt, unseeded: its own draws
    # ... and in a different batch order and size.
    outs = llm.generate([prompts[3], prompts[2], PROMPT], [params[3], params[2], target])
    assert outs[2].output_ids == alone.output_ids


@pytest.mark.parametrize("cfg", [dict(disable_overlap=True), dict(page_size=1),
                                 dict(chunked_prefill_size=8, max_prefill_tokens=8)],
                         ids=["normal-loop", "page-1", "chunked-8"])
def test_seeded_output_independent_of_engine_config(cfg):
    ref = get_llm("tiny-llama").generate([PROMPT], sampled(99, temperature=0.8))[0]
    other = get_llm("tiny-llama", **cfg).generate(
        [random_prompt(50, seed=9), PROMPT], [sampled(None), sampled(99, temperature=0.8)])
    assert other[1].output_ids == ref.output_ids


def test_different_seeds_differ():
    llm = get_llm("tiny-llama")
    outs = llm.generate([PROMPT] * 4, [sampled(s) for s in range(4)])
    assert len({tuple(o.output_ids) for o in outs}) >= 3


def test_top_k_1_and_tiny_top_p_are_greedy():
    llm = get_llm("tiny-llama")
    ref = llm.generate([PROMPT], greedy(N, ignore_eos=True))[0].output_ids
    outs = llm.generate([PROMPT] * 4, [
        sampled(None, top_k=1),
        sampled(5, top_k=1, temperature=2.0),
        sampled(6, top_p=1e-9),
        sampled(None, top_p=1e-9, temperature=1.5),
    ])
    for o in outs:
        assert o.output_ids == ref


def _reference_probs(prompt: list[int], outputs: list[int], temperature: float):
    """transformers' next-token distributions at every output step (teacher forcing)."""
    m = hf_model("tiny-llama")
    ids = torch.tensor([prompt + outputs])
    with torch.no_grad():
        logits = m(ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(outputs)].float()
    return torch.softmax(logits / temperature, dim=-1)


def test_top_k_and_top_p_restrict_the_choices():
    llm = get_llm("tiny-llama")
    temp = 0.5
    k_out, p_out = llm.generate([PROMPT, PROMPT], [
        sampled(21, top_k=3, temperature=temp),
        sampled(22, top_p=0.05, temperature=temp),
    ])
    probs = _reference_probs(PROMPT, k_out.output_ids, temp)
    for step, tok in enumerate(k_out.output_ids):
        rank = int((probs[step] > probs[step, tok]).sum())
        assert rank < 3, f"step {step}: token of rank {rank} sampled with top_k=3"
    probs = _reference_probs(PROMPT, p_out.output_ids, temp)
    for step, tok in enumerate(p_out.output_ids):
        mass_before = float(probs[step][probs[step] > probs[step, tok]].sum())
        assert mass_before < 0.05 + 1e-4, f"step {step}: outside the top-p nucleus"
    assert k_out.output_ids != p_out.output_ids


# -- the sampler alone, on hand-made distributions ------------------------------------------


def _draw(logits_row: list[float], n: int, **kw) -> torch.Tensor:
    logits = torch.tensor([logits_row] * n).log()
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    batch = SamplingBatch(
        temperature=torch.full((n,), kw.get("temperature", 1.0)),
        top_p=torch.full((n,), kw.get("top_p", 1.0)),
        top_k=torch.full((n,), kw.get("top_k", -1), dtype=torch.int64),
        generators=gens, all_greedy=False,
    )
    return Sampler(torch.device("cpu"), 0)(logits, batch)


DIST = [0.05, 0.4, 0.1, 0.3, 0.15]  # ranks: 1, 3, 4, 2, 0


def test_sampler_top_p():
    got = set(_draw(DIST, 400, top_p=0.5).tolist())
    assert got == {1, 3}  # 0.4 + 0.3 covers 0.5; nothing else may appear
    assert set(_draw(DIST, 50, top_p=0.3).tolist()) == {1}
    assert set(_draw(DIST, 400, top_p=1.0).tolist()) == {0, 1, 2, 3, 4}


def test_sampler_top_k_and_temperature():
    assert set(_draw(DIST, 400, top_k=2).tolist()) == {1, 3}
    assert set(_draw(DIST, 400, top_k=3, top_p=0.99).tolist()) == {1, 3, 4}
    assert set(_draw(DIST, 50, temperature=1e-3).tolist()) == {1}
    hot = _draw(DIST, 2000, temperature=5.0).tolist()
    cold = _draw(DIST, 2000, temperature=0.5).tolist()
    assert hot.count(0) > cold.count(0)  # a higher temperature flattens the distribution


def test_sampler_mixes_greedy_rows():
    logits = torch.tensor([DIST, DIST, DIST]).log()
    batch = SamplingBatch(
        temperature=torch.tensor([0.0, 1.0, 0.0]), top_p=torch.ones(3),
        top_k=torch.tensor([-1, -1, -1]), generators=[None, torch.Generator().manual_seed(0),
                                                     None],
        all_greedy=False,
    )
    for _ in range(20):
        out = Sampler(torch.device("cpu"), 0)(logits, batch)
        assert out[0] == 1 and out[2] == 1
