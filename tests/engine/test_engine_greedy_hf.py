"""Greedy output equals transformers `generate` token for token (docs/architecture.md: Memory)."""

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
    hf_greedy,
)

SMOLLM = "smollm2-135m"
SMOLLM_NEW_TOKENS = 32
_LONG = " ".join(
    f"Step {i}: the engineer checked the {part} of the machine and wrote down what she saw."
    for i, part in enumerate(["pump", "valve", "gearbox", "fan", "belt", "sensor", "boiler",
                              "motor", "filter", "switch", "relay", "spring", "bearing",
                              "shaft", "clutch", "piston"])
) + " In the end, the report said"
SMOLLM_PROMPTS = [
    "The capital of France is",
    "Hi",
    "Once upon a time",
    "def fibonacci(n):",
    "List three colors:",
    "Water boils at a temperature of",
    "Q: What is the largest planet in our solar system?\nA:",
    "The theory of relativity was developed by Albert Einstein in the early twentieth "
    "century, and it",
    "Here is a short recipe for pancakes. Ingredients: flour, milk, eggs, sugar and a "
    "pinch of salt. Steps: 1.",
    _LONG,
]


@pytest.mark.parametrize("model", TINY_MODELS)
def test_tiny_greedy_matches_transformers(model):
    ours = baseline_greedy(model)  # all prompts batched together in one generate call
    for prompt, out in zip(TINY_PROMPTS, ours, strict=True):
        ref = hf_greedy(model, prompt, TINY_NEW_TOKENS, stop_at_eos=False)
        assert len(ref) == TINY_NEW_TOKENS
        assert list(out) == list(ref), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("model", TINY_MODELS)
def test_tiny_greedy_matches_transformers_normal_loop(model):
    llm = get_llm(model, disable_overlap=True, page_size=1)
    outs = llm.generate([list(p) for p in TINY_PROMPTS[-4:]],
                        greedy(TINY_NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(TINY_PROMPTS[-4:], outs, strict=True):
        assert out.output_ids == list(hf_greedy(model, prompt, TINY_NEW_TOKENS, False))


def _smollm_ids(llm) -> list[list[int]]:
    return [llm.encode(p) for p in SMOLLM_PROMPTS]


def test_smollm2_prompts_cover_lengths():
    llm = get_llm(SMOLLM)
    lens = sorted(len(ids) for ids in _smollm_ids(llm))
    assert len(lens) >= 8 and len(set(lens)) >= 8
    assert lens[0] <= 2 and lens[-1] > 300


@functools.cache
def _smollm_batched() -> tuple[tuple[int, ...], ...]:
    """All SMOLLM_PROMPTS in one generate call on the default (overlap) engine."""
    llm = get_llm(SMOLLM)
    outs = llm.generate(_smollm_ids(llm), greedy(SMOLLM_NEW_TOKENS, ignore_eos=True))
    assert all(o.finish_reason == "length" for o in outs)
    for o in outs:
        assert o.text == llm.tokenizer.decode(o.output_ids, skip_special_tokens=True)
    return tuple(tuple(o.output_ids) for o in outs)


def test_smollm2_greedy_matches_transformers_batched():
    llm = get_llm(SMOLLM)
    mismatches = []
    for prompt, ids, out in zip(SMOLLM_PROMPTS, _smollm_ids(llm), _smollm_batched(),
                                strict=True):
        ref = hf_greedy(SMOLLM, tuple(ids), SMOLLM_NEW_TOKENS, stop_at_eos=False)
        assert len(ref) == SMOLLM_NEW_TOKENS
        if list(out) != list(ref):
            mismatches.append((prompt[:40], len(ids), list(out), list(ref)))
    assert not mismatches, mismatches


def test_smollm2_overlap_equals_normal():
    """The normal loop (and page size 1) on the short prompts gives the overlap loop's
    tokens (the long prompt is left out to keep the suite fast on CPU)."""
    llm = get_llm(SMOLLM, disable_overlap=True, page_size=1)
    ids = _smollm_ids(llm)[:6]
    outs = llm.generate(ids, greedy(SMOLLM_NEW_TOKENS, ignore_eos=True))
    assert [o.output_ids for o in outs] == [list(o) for o in _smollm_batched()[:6]]


def test_smollm2_eos_stops_unless_ignored():
    """SmolLM2 ends this answer with EOS within 40 tokens; transformers stops there too."""
    llm = get_llm(SMOLLM)
    ids = llm.encode(SMOLLM_PROMPTS[0])
    eos = llm.engine.loaded.eos_token_ids
    stop, cont = llm.generate([ids, ids], [greedy(40), greedy(40, ignore_eos=True)])
    assert stop.finish_reason == "stop"
    assert stop.output_ids[-1] in eos
    assert not any(t in eos for t in stop.output_ids[:-1])
    assert len(stop.output_ids) < 40
    assert stop.output_ids == list(hf_greedy(SMOLLM, tuple(ids), 40, stop_at_eos=True))
    assert cont.finish_reason == "length"
    assert len(cont.output_ids) == 40
    assert cont.output_ids[: len(stop.output_ids)] == stop.output_ids
    assert stop.text == llm.tokenizer.decode(stop.output_ids, skip_special_tokens=True)


@functools.cache
def _gguf_reference():
    """transformers on the original GGUF file (de-quantized by transformers, fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.models.smollm2 import gguf_path

    src = gguf_path()
    return AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                dtype=torch.float32).eval()


def test_smollm2_converted_weights_are_the_gguf_values():
    """The converter keeps the de-quantized values exactly (fp32 on disk), so our fp32
    engine and transformers-on-the-GGUF hold the very same weights."""
    llm = get_llm(SMOLLM)
    ours = dict(llm.engine.loaded.model.named_parameters())
    ref = _gguf_reference().state_dict()
    q, k, v = (ref[f"model.layers.3.self_attn.{n}_proj.weight"] for n in "qkv")
    import torch

    assert torch.equal(ours["model.layers.3.self_attn.qkv_proj.weight"], torch.cat([q, k, v]))
    assert torch.equal(ours["model.embed_tokens.weight"], ref["model.embed_tokens.weight"])
    down = "model.layers.17.mlp.down_proj.weight"
    assert torch.equal(ours[down], ref[down])


@pytest.mark.slow  # the converted weights equal the GGUF's (above): the same greedy tokens
def test_smollm2_greedy_matches_transformers_on_the_gguf():
    import torch

    m = _gguf_reference()
    m.generation_config.eos_token_id = None  # as hf_greedy(stop_at_eos=False): EOS may win
    llm = get_llm(SMOLLM)
    mismatches = []
    for ids, out in zip(_smollm_ids(llm), _smollm_batched(), strict=True):
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = m.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=SMOLLM_NEW_TOKENS, pad_token_id=0)
        ref = ref[0, len(ids):].tolist()
        if list(out) != ref:
            mismatches.append((len(ids), list(out), ref))
    _gguf_reference.cache_clear()
    assert not mismatches, mismatches
