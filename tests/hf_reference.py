"""transformers' greedy `generate`, the reference every token-exactness test compares with
(importable from any test folder: tests/ is on sys.path through tests/conftest.py)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def hf_model(model: str):
    from transformers import AutoModelForCausalLM

    from pdserve.models.builtin import resolve_model

    return AutoModelForCausalLM.from_pretrained(resolve_model(model),
                                                dtype=torch.float32).eval()


@functools.cache
def hf_greedy(model: str, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    """transformers `generate`, greedy, fp32, no padding, EOS ignored."""
    m = hf_model(model)
    saved, m.generation_config.eos_token_id = m.generation_config.eos_token_id, None
    try:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, pad_token_id=0)
    finally:
        m.generation_config.eos_token_id = saved
    return tuple(out[0, len(prompt):].tolist())
