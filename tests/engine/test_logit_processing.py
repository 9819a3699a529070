"""Penalties, min_p, logit_bias and min_new_tokens (docs/architecture.md: Sampling), checked
against a reference implementation of their formulas on transformers' logits."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import get_llm, greedy, hf_model, random_prompt

from pdserve import SamplingParams
from pdserve.engine.logit_processing import LogitProcessor, PenaltyBook, logit_inputs
from pdserve.engine.request import Req
from pdserve.engine.sampler import Sampler, SamplingBatch

N = 24


def reference_logits(logits: torch.Tensor, prompt: list[int], outputs: list[int],
                     p: SamplingParams, eos: list[int]) -> torch.Tensor:
    """The formulas, one token at a time (no vectorisation), in vLLM's order: logit_bias
    added, CTRL's repetition penalty over prompt + generated tokens, OpenAI's frequency and
    presence penalties over generated tokens, EOS and stop ids banned before min_new_tokens
    outputs."""
    x = logits.clone()
    for t, b in (p.logit_bias or {}).items():
        x[int(t)] += b
    counts: dict[int, int] = {}
    for t in outputs:
        counts[t] = counts.get(t, 0) + 1
    for t in set(prompt) | set(outputs):
        v = float(x[t])
        x[t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
    for t, c in counts.items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    if len(outputs) < p.min_new_tokens:
        for t in set(eos) | set(p.stop_token_ids):
            x[t] = float("-inf")
    return x


def reference_greedy(model: str, prompt: list[int], p: SamplingParams, eos: list[int]
                     ) -> list[int]:
    m = hf_model(model)
    out: list[int] = []
    for _ in range(p.max_new_tokens):
        with torch.no_grad():
            logits = m(torch.tensor([prompt + out])).logits[0, -1].float()
        tok = int(reference_logits(logits, prompt, out, p, eos).argmax())
        out.append(tok)
        if tok in eos and not p.ignore_eos:
            break
    return out


def _req(prompt, outputs, params, slot, eos=(2,)) -> Req:
    r = Req("r", prompt, params, list(eos))
    r.output_ids, r.slot, r.launched_outputs = list(outputs), slot, len(outputs) + 1
    return r


def test_processor_matches_the_formulas_on_random_logits():
    torch.manual_seed(0)
    V = 50
    cases = [
        (SamplingParams(frequency_penalty=0.7, presence_penalty=-0.3), [1, 5, 5], [5, 7, 7, 7]),
        (SamplingParams(repetition_penalty=1.8), [3, 4, 9], [9, 11]),
        (SamplingParams(repetition_penalty=0.6, frequency_penalty=-1.5), [8], [8, 8, 20]),
        (SamplingParams(logit_bias={"6": 50.0, 7: -100}), [1], [2]),
        (SamplingParams(min_new_tokens=5, stop_token_ids=[13]), [1], [4]),
        (SamplingParams(), [1, 2], [3]),  # a plain row beside processed ones
    ]
    reqs = [_req(prompt, out, p, slot=i) for i, (p, prompt, out) in enumerate(cases)]
    ints, floats = logit_inputs(reqs, PenaltyBook())
    t = ints | floats
    proc = LogitProcessor(len(cases), torch.device("cpu"))
    logits = torch.randn(len(cases), V) * 3
    got = proc.apply(logits, t)
    for i, (p, prompt, out) in enumerate(cases):
        want = reference_logits(logits[i], prompt, out, p, [2])
        torch.testing.assert_close(got[i], want, msg=f"case {i}")
    assert torch.equal(logits, logits.clone())  # the raw logits are left alone


def test_counts_follow_sampled_tokens_without_the_host():
    """The device counts grow with each sampled token; the host never re-sends them (the
    overlap loop packs the next batch before it knows this one's tokens)."""
    p = SamplingParams(frequency_penalty=1.0)
    book, proc = PenaltyBook(), LogitProcessor(4, torch.device("cpu"))
    req = _req([1], [], p, slot=2)
    logits = torch.zeros(1, 10)
    for step, tok in enumerate([4, 4, 6]):
        ints, floats = logit_inputs([req], book)
        assert bool(ints["lx_init_slots"].numel()) == (step == 0)
        x = proc.apply(logits, ints | floats)
        proc.record(ints | floats, torch.tensor([tok]))
    assert proc.counts[2, 4] == 2 and proc.counts[2, 6] == 1
    assert float(x[0, 4]) == -2.0  # two 4s were counted before the third step
    # A new request in the same slot starts from its own outputs.
    other = _req([1], [6], p, slot=2)
    ints, floats = logit_inputs([other], book)
    x = proc.apply(logits, ints | floats)
    assert float(x[0, 4]) == 0.0 and float(x[0, 6]) == -1.0


def test_min_p_drops_unlikely_tokens():
    dist = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 400).log()
    gens = [torch.Generator().manual_seed(i) for i in range(400)]
    batch = SamplingBatch(torch.ones(400), torch.ones(400), torch.full((400,), -1), gens,
                          False, torch.full((400,), 0.35))
    got = set(Sampler(torch.device("cpu"), 0)(dist, batch).tolist())
    assert got == {0, 1}  # 0.15 and 0.05 are below 0.35 x 0.5


PROMPT = random_prompt(30, seed=11)
# The tiny random model never repeats a token on its own, so each case biases tokens up
# (top logits are ~5) and checks that the penalty then pushes them back.
B = {"17": 6.0, "42": 5.5}
PENALIZED = [
    dict(logit_bias=B, frequency_penalty=1.5),
    dict(logit_bias=B, presence_penalty=2.0, repetition_penalty=1.3),
    dict(logit_bias={str(PROMPT[0]): 6.0}, repetition_penalty=3.0),
    dict(logit_bias=B, frequency_penalty=-1.0, presence_penalty=0.3),
]


def _without_penalties(kw: dict) -> dict:
    return {k: v for k, v in kw.items() if k == "logit_bias"}


@pytest.mark.parametrize("loop", ["overlap", "normal"])
def test_engine_greedy_with_penalties_equals_reference(loop):
    llm = get_llm("tiny-llama", disable_overlap=loop == "normal")
    eos = llm.engine.loaded.eos_token_ids
    params = [greedy(N, **kw) for kw in PENALIZED]
    controls = [greedy(N, **_without_penalties(kw)) for kw in PENALIZED]
    plain = llm.generate([PROMPT], greedy(N))[0].output_ids
    # All in one batch, with unpenalized requests beside them.
    outs = llm.generate([PROMPT] * (2 * len(params) + 1), params + controls + [greedy(N)])
    for i, (kw, p) in enumerate(zip(PENALIZED, params, strict=True)):
        assert outs[i].output_ids == reference_greedy("tiny-llama", PROMPT, p, eos), kw
        control = outs[len(params) + i].output_ids
        assert control == reference_greedy("tiny-llama", PROMPT, controls[i], eos)
        assert outs[i].output_ids != control, f"{kw}: the penalty changed nothing"
    assert outs[-1].output_ids == plain


def test_min_new_tokens_holds_eos_back():
    llm = get_llm("tiny-llama")
    eos = llm.engine.loaded.eos_token_ids[0]
    # Bias EOS so high that it is the greedy choice from the first step on.
    params = greedy(10, logit_bias={str(eos): 100.0})
    assert llm.generate([PROMPT], params)[0].output_ids == [eos]
    params = greedy(10, logit_bias={str(eos): 100.0}, min_new_tokens=4)
    out = llm.generate([PROMPT], params)[0]
    assert len(out.output_ids) == 5 and out.output_ids[-1] == eos
    assert eos not in out.output_ids[:4]


def test_logit_bias_outside_the_vocabulary_is_refused():
    llm = get_llm("tiny-llama")
    vocab = llm.engine.loaded.hf_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias names token"):
        llm.generate([PROMPT], greedy(4, logit_bias={str(vocab): 1.0}))
    with pytest.raises(ValueError, match="frequency_penalty"):
        llm.generate([PROMPT], greedy(4, frequency_penalty=3.0))
