"""CUDA graphs of decode batches on a GPU (pdserve/engine/cuda_graphs.py): captured at
start-up, replayed for decode batches, and the greedy tokens equal the eager engine's and
transformers' (fp32 tiny-llama) on both loops, with batches padded as requests finish;
bf16 too against the eager engine; pools back to full. Run by scripts/gpu_check.sh."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TINY_PROMPTS, pool_problems, random_prompt
from test_gpu_engine import greedy, hf_greedy

from pdserve import LLM

pytestmark = pytest.mark.timeout(600)


def _generate(llm: LLM, prompts, budgets) -> list[list[int]]:
    params = [greedy(n) for n in budgets]
    return [o.output_ids for o in llm.generate([list(p) for p in prompts], params)]


@pytest.mark.parametrize("loop,dtype", [("overlap", "float32"), ("normal", "float32"),
                                        ("overlap", "bfloat16")])
def test_graph_replays_give_the_eager_tokens(loop: str, dtype: str) -> None:
    prompts = [random_prompt(7 + 31 * i, seed=5100 + i) for i in range(9)]
    budgets = [12 + 7 * i for i in range(9)]  # finish at different steps: 9..1 rows
    kw = dict(device="cuda", dtype=dtype, loop=loop, max_total_tokens=32768,
              max_running_requests=16)
    eager = LLM("tiny-llama", cuda_graph_max_bs=0, **kw)
    try:
        assert not eager.engine.describe()["cuda_graphs"]["enabled"]
        ref = _generate(eager, prompts, budgets)
    finally:
        eager.close()
    llm = LLM("tiny-llama", **kw)
    try:
        info = llm.engine.describe()["cuda_graphs"]
        assert info["enabled"], info["reason"]
        out = _generate(llm, prompts, budgets)
        assert out == ref
        assert llm.engine.describe()["cuda_graphs"]["replays"] >= 60
        if dtype == "float32":
            for prompt, got, n in list(zip(prompts, out, budgets, strict=True))[:3]:
                assert got == hf_greedy("tiny-llama", list(prompt), n)
        assert not pool_problems(llm)
    finally:
        llm.close()


def test_graphs_and_transformers_on_the_tiny_prompts() -> None:
    llm = LLM("tiny-llama", device="cuda", dtype="float32", loop="overlap",
              max_total_tokens=32768, max_running_requests=64)
    try:
        assert llm.engine.runner.graphs is not None
        assert torch.cuda.is_available()
        out = _generate(llm, TINY_PROMPTS, [16] * len(TINY_PROMPTS))
        for prompt, got in zip(TINY_PROMPTS, out, strict=True):
            assert got == hf_greedy("tiny-llama", list(prompt), 16), len(prompt)
        assert not pool_problems(llm)
    finally:
        llm.close()
