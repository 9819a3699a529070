"""Stop conditions: stop strings, stop token ids, max_new_tokens and the context limit.
(EOS with and without ignore_eos is in test_engine_greedy_hf.py, on SmolLM2, a model that
really ends its answers.)"""

from __future__ import annotations

import functools

import pytest
from engine_helpers import get_llm, greedy, random_prompt

TEXT = "Hello there, my name is"
N = 30


@functools.cache
def _full(overlap: bool) -> tuple[list[int], str]:
    llm = get_llm("tiny-llama", disable_overlap=not overlap)
    (out,) = llm.generate(TEXT, greedy(N, ignore_eos=True))
    assert out.finish_reason == "length"
    return out.output_ids, out.text


def _decode(ids: list[int]) -> str:
    return get_llm("tiny-llama").tokenizer.decode(ids, skip_special_tokens=True)


def _tokens_until(ids: list[int], stop: str) -> int:
    """Fewest leading output tokens whose text contains `stop`."""
    return next(n for n in range(1, len(ids) + 1) if stop in _decode(ids[:n]))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_stop_string_truncates_text(overlap):
    ids, text = _full(overlap)
    start = len(_decode(ids[:8]))
    stop = text[start + 1:start + 5]  # four characters from the middle of token 9
    assert len(stop) == 4 and stop.strip()
    llm = get_llm("tiny-llama", disable_overlap=not overlap)
    (out,) = llm.generate(TEXT, greedy(N, ignore_eos=True, stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]
    assert stop not in out.text
    n = _tokens_until(ids, stop)
    assert n < N
    assert out.output_ids == ids[:n]  # the token completing the stop string is the last


def test_earliest_of_several_stop_strings_wins():
    ids, text = _full(True)
    late = text[len(_decode(ids[:20])):][:3]
    early = text[len(_decode(ids[:5])):][:3]
    llm = get_llm("tiny-llama")
    (out,) = llm.generate(TEXT, greedy(N, ignore_eos=True, stop=[late, early]))
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(early)]
    (single,) = llm.generate(TEXT, greedy(N, ignore_eos=True, stop=early))  # str form
    assert single.text == out.text and single.output_ids == out.output_ids


def test_absent_stop_string_runs_to_length():
    ids, text = _full(True)
    llm = get_llm("tiny-llama")
    (out,) = llm.generate(TEXT, greedy(N, ignore_eos=True, stop=["\u2603never\u2603"]))
    assert out.finish_reason == "length"
    assert out.output_ids == ids and out.text == text


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_stop_token_ids(overlap):
    ids, _ = _full(overlap)
    stop_tok = ids[9]
    first = ids.index(stop_tok)
    llm = get_llm("tiny-llama", disable_overlap=not overlap)
    (out,) = llm.generate(TEXT, greedy(N, ignore_eos=True, stop_token_ids=[stop_tok, 3]))
    assert out.finish_reason == "stop"
    assert out.output_ids == ids[: first + 1]
    assert out.text.startswith(_decode(ids[:first]))


def test_stop_token_in_a_batch_leaves_others_alone():
    ids, _ = _full(True)
    llm = get_llm("tiny-llama")
    other = random_prompt(12, seed=4)
    ref_other = llm.generate([other], greedy(N, ignore_eos=True))[0].output_ids
    a, b = llm.generate([TEXT, other],
                        [greedy(N, ignore_eos=True, stop_token_ids=[ids[2]]),
                         greedy(N, ignore_eos=True)])
    assert a.output_ids == ids[:3] and a.finish_reason == "stop"
    assert b.output_ids == ref_other and b.finish_reason == "length"


@pytest.mark.parametrize("n", [1, 2, 7])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_max_new_tokens(n, overlap):
    ids, _ = _full(overlap)
    llm = get_llm("tiny-llama", disable_overlap=not overlap)
    (out,) = llm.generate(TEXT, greedy(n, ignore_eos=True))
    assert out.finish_reason == "length"
    assert out.output_ids == ids[:n]
    assert out.text == _decode(ids[:n])


def test_context_limit_ends_with_length():
    llm = get_llm("tiny-llama", context_length=64)
    prompt = random_prompt(60, seed=6)
    (out,) = llm.generate([prompt], greedy(50, ignore_eos=True))
    assert out.finish_reason == "length"
    assert len(prompt) + len(out.output_ids) == 64
    ref = get_llm("tiny-llama").generate([prompt], greedy(4, ignore_eos=True))[0]
    assert out.output_ids == ref.output_ids
