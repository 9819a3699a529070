"""Structured outputs with xgrammar (docs/architecture.md: Sampling): every sampled token
obeys the request's JSON schema, regex or EBNF grammar, in both loops; the tiny random
model's unconstrained output does not (so the checks can fail)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from engine_helpers import get_llm, random_prompt

from pdserve import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 6},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "kind": {"enum": ["person", "robot"]},
    },
    "required": ["name", "age", "tags", "address", "kind"],
    "additionalProperties": False,
}
PROMPTS = [random_prompt(5 + 3 * i, seed=300 + i) for i in range(20)]


def sampled(i: int, **kw) -> SamplingParams:
    kw.setdefault("max_new_tokens", 160)
    return SamplingParams(temperature=1.0, seed=i, **kw)


# strict=False: xgrammar 0.2.9 lets raw control characters into strings with a maxLength
# (seen: U+0015), which strict JSON forbids; the structure itself always validates.
def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text, strict=False), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.parametrize("loop", ["overlap", "normal"])
def test_json_schema_outputs_validate(loop):
    llm = get_llm("tiny-llama", disable_overlap=loop == "normal")
    outs = llm.generate(PROMPTS, [sampled(i, json_schema=json.dumps(SCHEMA))
                                  for i in range(len(PROMPTS))])
    bad = [o.text for o in outs if not valid(o.text)]
    assert not bad, bad[:3]
    assert all(o.finish_reason == "stop" for o in outs)
    assert len({o.text for o in outs}) > 10  # sampled, not one fixed answer
    free = llm.generate(PROMPTS[:5], [sampled(i) for i in range(5)])
    assert not any(valid(o.text) for o in free), "negative control: free text validated"


def test_both_loops_give_the_same_constrained_tokens():
    params = [sampled(i, json_schema=json.dumps(SCHEMA)) for i in range(6)]
    a = get_llm("tiny-llama").generate(PROMPTS[:6], params)
    b = get_llm("tiny-llama", disable_overlap=True).generate(PROMPTS[:6], params)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]


def test_grammar_rows_beside_free_rows_and_penalties():
    llm = get_llm("tiny-llama")
    params = [sampled(0, regex=r"[a-c]{3}-[0-9]{2}"), sampled(1),
              sampled(2, ebnf='root ::= "yes" | "no" | "maybe " [0-9]'),
              sampled(3, json_schema=json.dumps(SCHEMA), frequency_penalty=1.0)]
    outs = llm.generate(PROMPTS[:4], params)
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", outs[0].text), outs[0].text
    assert re.fullmatch(r"yes|no|maybe [0-9]", outs[2].text), outs[2].text
    assert valid(outs[3].text), outs[3].text
    assert outs[1].finish_reason == "length"  # the free row is left alone


def test_json_object_mode_and_chunked_prefill():
    llm = get_llm("tiny-llama", chunked_prefill_size=8, max_prefill_tokens=8)
    outs = llm.generate(PROMPTS[10:14], [sampled(i, json_schema='{"type": "object"}',
                                                 max_new_tokens=60) for i in range(4)])
    for o in outs:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict), o.text
        else:  # an open-ended object may run out of tokens; its prefix is still an object
            assert o.text.startswith("{"), o.text


def test_a_grammar_that_does_not_compile_fails_only_its_request():
    llm = get_llm("tiny-llama")
    good = sampled(0, regex="[0-9]{4}")
    bad = sampled(1, regex="([0-9")
    with pytest.raises(RuntimeError, match="invalid regex"):
        llm.generate(PROMPTS[:2], [good, bad])
    out = llm.generate(PROMPTS[:1], good)[0]  # the engine goes on serving
    assert re.fullmatch("[0-9]{4}", out.text)


def test_a_failed_compile_never_lets_its_request_sample():
    """The compile may fail between the engine's check of finished compiles and batch
    selection in the same step; the request must then stay out of batches until the next
    step fails it (seen in CI: an unguarded mask fill raised the compile error and failed
    every live request)."""
    from concurrent.futures import Future

    from pdserve.engine.grammar import GrammarError, RequestGrammar
    from pdserve.engine.request import Req

    fut: Future = Future()
    req = Req("r", [1, 2, 3], SamplingParams(max_new_tokens=4), eos_ids=[2])
    req.grammar = RequestGrammar(fut, 0, [2])
    assert not req.grammar_ready  # compiling
    fut.set_exception(GrammarError("invalid regex: boom"))
    assert req.grammar.ready and req.grammar.error() == "invalid regex: boom"
    assert not req.grammar_ready  # failed: never sampled


def test_malformed_constraints_are_refused_before_queueing():
    llm = get_llm("tiny-llama")
    with pytest.raises(ValueError, match="not valid JSON"):
        llm.generate(PROMPTS[:1], sampled(0, json_schema="{nope"))
    with pytest.raises(ValueError, match="at most one of"):
        llm.generate(PROMPTS[:1], sampled(0, json_schema="{}", regex="a"))


def test_a_continuation_replays_its_resumed_outputs():
    """What the router sends after a migration: the prompt plus the tokens already sent,
    `resumed_outputs` saying how many. The matcher and the penalties count them as output,
    so the continuation equals the rest of the uninterrupted run."""
    llm = get_llm("tiny-llama")
    kw = dict(json_schema=json.dumps(SCHEMA), frequency_penalty=0.8, temperature=0.0)
    full = llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=80, **kw))[0].output_ids
    k = 9
    rest = llm.generate([PROMPTS[0] + full[:k]], SamplingParams(
        max_new_tokens=80 - k, resumed_outputs=k, **kw))[0].output_ids
    assert full[:k] + rest == full
    # Without resumed_outputs the grammar starts over inside the JSON: a different answer.
    fresh = llm.generate([PROMPTS[0] + full[:k]], SamplingParams(max_new_tokens=80 - k,
                                                                   **kw))[0].output_ids
    assert fresh != rest


def test_logprobs_of_constrained_tokens_are_the_models():
    """Logprobs report the raw distribution (as vLLM's do): the mask changes which token is
    sampled, not the reported logprob of it."""
    llm = get_llm("tiny-llama")
    kw = dict(json_schema=json.dumps(SCHEMA), max_new_tokens=30, temperature=0.0)
    plain = llm.generate(PROMPTS[:1], SamplingParams(**kw))[0]
    lp = llm.generate(PROMPTS[:1], SamplingParams(logprobs=2, **kw))[0]
    assert lp.output_ids == plain.output_ids
    assert len(lp.logprobs) == len(lp.output_ids)
    free = llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=1, temperature=0.0,
                                                     logprobs=2))[0]
    # Step 0: the constrained token's logprob is below the model's best (it was masked in).
    first, best = lp.logprobs[0][0], free.logprobs[0][0]
    assert first <= best + 1e-6


def test_a_compiling_grammar_is_waited_for_not_spun_on(monkeypatch):
    """While the only request's grammar compiles, each engine step waits on the compile
    (5 ms at most) instead of returning at once: a spinning scheduler would hold the GIL
    the compile thread needs. Negative control: without the wait, thousands of steps."""
    import threading
    import time

    from pdserve.engine.grammar import GrammarCompiler

    llm = get_llm("tiny-llama", disable_overlap=True)
    gate = threading.Event()
    real = GrammarCompiler._compile

    def slow(self, kind, text):
        gate.wait(10)
        return real(self, kind, text)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    eng = llm.engine
    eng.add_request("gated", PROMPTS[0], sampled(0, regex="[0-9]{3}", max_new_tokens=8))
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.3:
        eng.step()
        steps += 1
    gate.set()
    done = []
    while eng.has_work():
        done += eng.step()
    eng.drain()
    assert steps < 150, f"{steps} steps in 0.3 s: the scheduler spun on the compile"
    assert re.fullmatch("[0-9]{3}", done[0].text), done[0].text


@pytest.mark.parametrize("loop", ["overlap", "normal"])
def test_ignore_eos_after_a_complete_match_repeats_the_stop_token(loop):
    """With ignore_eos the request goes on after its JSON is complete: the grammar then
    allows only the model's stop tokens (never an empty mask, which would break sampling)."""
    llm = get_llm("tiny-llama", disable_overlap=loop == "normal")
    eos = llm.engine.loaded.eos_token_ids
    out = llm.generate(PROMPTS[:2], [sampled(i, json_schema='{"type": "boolean"}',
                                             max_new_tokens=12, ignore_eos=True)
                                     for i in range(2)])
    for o in out:
        assert len(o.output_ids) == 12 and o.finish_reason == "length"
        first_stop = next(i for i, t in enumerate(o.output_ids) if t in eos)
        assert o.text in ("true", "false"), o.text
        assert all(t in eos for t in o.output_ids[first_stop:])
