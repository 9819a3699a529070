"""`--attention-backend triton`, end to end on CPU under Triton's interpreter: the engine's
greedy tokens equal transformers `generate` and the default engine's, with decode rows and
prompt rows (fresh, chunked, prefix hits, mixed with decode rows) all served by the Triton
kernels. The interpreter is slow, so the prompts are few and the outputs short; the kernels'
shapes are covered in tests/kernels/test_triton_attention.py."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    TINY_PROMPTS,
    discard_llm,
    get_llm,
    greedy,
    hf_greedy,
    pool_problems,
    random_prompt,
    run_ids,
)

from pdserve.config import EngineConfig
from pdserve.models.attention_backends import choose_attention
from pdserve.models.ops import TorchOps

NEW = 6
PROMPTS = [TINY_PROMPTS[i] for i in (3, 4, 7)]  # 16, 17, 65 tokens


def test_greedy_equals_transformers_and_the_default_engine():
    llm = get_llm("tiny-llama", attention_backend="triton")
    info = llm.engine.describe()
    assert info["attention_backend"] == "triton"
    assert info["attention"] == {"decode": "paged kernel", "prompt": "paged kernel"}
    params = greedy(NEW, ignore_eos=True)
    outs = run_ids(llm, PROMPTS, params)
    assert outs == run_ids(get_llm("tiny-llama"), PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out == list(hf_greedy("tiny-llama", prompt, NEW, stop_at_eos=False))
    assert not pool_problems(llm)
    discard_llm(llm)


def test_chunks_mixed_batches_and_prefix_hits_change_no_token():
    """Chunks of 24 under a 40-token budget (most batches mixed: chunk rows beside decode
    rows), then prompts that share a cached prefix (extend rows that start mid-context)."""
    llm = get_llm("tiny-qwen2", attention_backend="triton", chunked_prefill_size=24,
                  max_prefill_tokens=40)
    ref = get_llm("tiny-qwen2", attention_backend="torch")
    params = greedy(NEW, ignore_eos=True)
    base = random_prompt(40, seed=77)
    prompts = [PROMPTS[1], PROMPTS[2], base + random_prompt(9, seed=78)]
    first = run_ids(llm, prompts, params)
    assert llm.engine.sched.num_mixed_batches > 0
    hits = [base + random_prompt(5, seed=79), prompts[2]]
    second = run_ids(llm, hits, params)
    assert llm.engine.kv.cache.hit_tokens > 0
    assert first + second == run_ids(ref, prompts + hits, params)
    assert not pool_problems(llm)
    discard_llm(llm)


def test_backend_choices_and_refusals():
    cpu = torch.device("cpu")
    assert choose_attention("auto", TorchOps(), cpu).backend == "torch"
    assert choose_attention("triton", TorchOps(), cpu).backend == "triton"  # interpreter
    with pytest.raises(ValueError, match="fused CPU kernels"):
        choose_attention("native", TorchOps(), cpu)
    with pytest.raises(ValueError, match="attention backend must be"):
        choose_attention("flash", TorchOps(), cpu)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")
