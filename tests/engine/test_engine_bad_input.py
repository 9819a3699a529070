"""Bad input raises a clear ValueError and leaves the engine usable (issue 2)."""

from __future__ import annotations

import json

import pytest
from engine_helpers import get_llm, greedy, random_prompt

from pdserve import LLM, SamplingParams

CTX = 64


def _small_ctx():
    return get_llm("tiny-llama", context_length=CTX)


def _still_works(llm) -> None:
    """A good request after the error succeeds, and nothing of the bad one was queued."""
    assert not llm.engine.requests and not llm.engine.sched.has_work()
    assert llm.engine.pools_full()
    (out,) = llm.generate([random_prompt(10, seed=1)], greedy(5, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.output_ids) == 5
    assert llm.engine.pools_full()


BAD_PROMPTS = {
    "empty-string": ("", "prompt is empty"),
    "empty-ids": ([[]], "prompt is empty"),
    "at-context": ([random_prompt(CTX, seed=2)], "context length"),
    "over-context": ([random_prompt(CTX + 40, seed=2)], "context length"),
    "id-over-vocab": ([[5, 49152]], "token ids"),
    "negative-id": ([[5, -1]], "token ids"),
}


@pytest.mark.parametrize("case", list(BAD_PROMPTS))
def test_bad_prompt(case):
    llm = _small_ctx()
    prompts, msg = BAD_PROMPTS[case]
    with pytest.raises(ValueError, match=msg):
        llm.generate(prompts, greedy(4))
    _still_works(llm)


def test_prompt_over_context_message_names_the_limit():
    llm = _small_ctx()
    with pytest.raises(ValueError) as err:
        llm.generate([random_prompt(100, seed=3)], greedy(4))
    assert "100" in str(err.value) and str(CTX) in str(err.value)


BAD_PARAMS = {
    "max-new-0": (dict(max_new_tokens=0), "max_new_tokens"),
    "max-new-negative": (dict(max_new_tokens=-3), "max_new_tokens"),
    "temperature-negative": (dict(temperature=-0.5), "temperature"),
    "top-p-0": (dict(top_p=0.0), "top_p"),
    "top-p-over-1": (dict(top_p=1.5), "top_p"),
    "top-p-negative": (dict(top_p=-0.1), "top_p"),
    "top-k-negative": (dict(top_k=-2), "top_k"),
    "stop-token-negative": (dict(stop_token_ids=[-4]), "stop_token_ids"),
}


@pytest.mark.parametrize("case", list(BAD_PARAMS))
def test_bad_sampling_params(case):
    llm = _small_ctx()
    kw, msg = BAD_PARAMS[case]
    with pytest.raises(ValueError, match=msg):
        llm.generate([random_prompt(5, seed=4)], SamplingParams(**kw))
    _still_works(llm)


def test_one_bad_request_queues_none_of_the_batch():
    llm = _small_ctx()
    good = [random_prompt(8, seed=5), random_prompt(9, seed=6)]
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(good + [random_prompt(4, seed=7)],
                     [greedy(4), greedy(4), SamplingParams(top_p=2.0)])
    _still_works(llm)
    with pytest.raises(ValueError, match="one SamplingParams per prompt"):
        llm.generate(good, [greedy(4)])
    _still_works(llm)


def test_request_larger_than_the_kv_pool():
    llm = get_llm("tiny-llama", page_size=4, max_total_tokens=256)
    with pytest.raises(ValueError, match="KV"):
        llm.generate([random_prompt(200, seed=8)], greedy(100))
    _still_works(llm)


def test_bad_request_through_engine_api():
    llm = _small_ctx()
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.engine.add_request("bad-1", [], greedy(3))
    with pytest.raises(ValueError, match="temperature"):
        llm.engine.add_request("bad-2", [5, 6], SamplingParams(temperature=-1))
    _still_works(llm)


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'") as err:
        LLM("no-such-model")
    assert "tiny-llama" in str(err.value)  # says what would work


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 100,
        "n_embd": 32, "n_layer": 1, "n_head": 2,
    }))
    with pytest.raises(ValueError, match="unsupported architecture") as err:
        LLM(str(tmp_path))
    assert "GPT2LMHeadModel" in str(err.value)
    assert "LlamaForCausalLM" in str(err.value)  # names what is supported


def test_model_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("kw, msg", [
    (dict(page_size=0), "page_size"),
    (dict(schedule_policy="random"), "schedule_policy"),
    (dict(dtype="int8"), "dtype"),
])
def test_bad_engine_config(kw, msg):
    with pytest.raises(ValueError, match=msg):
        LLM("tiny-llama", **kw)


def test_unknown_engine_option():
    with pytest.raises(TypeError, match="no_such_option"):
        LLM("tiny-llama", no_such_option=1)
