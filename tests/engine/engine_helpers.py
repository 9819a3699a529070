"""Shared machinery of the engine tests: one LLM per configuration, transformers references.

Loading an engine costs about a second (tiny models) or several (smollm2-135m), so every
configuration is built once per test module by `get_llm` and reused (tests/conftest.py
closes them when the module ends: memory stays bounded by one module's engines). Every
LLM handed out is recorded in `USED`; the autouse fixture in conftest.py checks after each
test that all of them are idle with their KV pages and request slots back to full.
"""

from __future__ import annotations

import functools
import itertools
import random

import hf_reference
import torch
from hf_reference import hf_model

from pdserve import LLM, SamplingParams

# Defaults keep each KV pool small: the tiny models would otherwise get 512 MiB each.
# The overlap loop is asked for explicitly (auto picks the normal loop on a 2-core CPU), so
# `disable_overlap=False` in a test still means "the overlap loop".
DEFAULTS: dict[str, dict] = {
    "tiny-llama": {"max_total_tokens": 16384, "loop": "overlap"},
    "tiny-qwen2": {"max_total_tokens": 16384, "loop": "overlap"},
    "smollm2-135m": {"max_total_tokens": 8192, "dtype": "float32", "loop": "overlap"},
}
TINY_MODELS = ("tiny-llama", "tiny-qwen2")

_LLMS: dict[tuple, LLM] = {}
USED: list[LLM] = []


def _key(model: str, cfg: dict) -> tuple:
    return (model, tuple(sorted(cfg.items())))


def get_llm(model: str = "tiny-llama", **cfg) -> LLM:
    """The session's LLM for `model` with these engine options (built on first use)."""
    cfg = {**DEFAULTS.get(model, {}), **cfg}
    key = _key(model, cfg)
    llm = _LLMS.get(key)
    if llm is None:
        llm = _LLMS[key] = LLM(model, **cfg)
    if llm not in USED:
        USED.append(llm)
    return llm


def discard_llm(llm: LLM) -> None:
    """Forget an LLM (after a failed test left it in an unknown state, or to free memory)."""
    for key, value in list(_LLMS.items()):
        if value is llm:
            del _LLMS[key]
    if llm in USED:
        USED.remove(llm)
    llm.close()


def discard_model(model: str) -> None:
    for key, llm in list(_LLMS.items()):
        if key[0] == model:
            discard_llm(llm)


def close_all() -> None:
    for llm in list(_LLMS.values()):
        discard_llm(llm)


def pool_problems(llm: LLM) -> list[str]:
    """Empty when `llm` is idle, holds no KV or slot, and frees every page on cache reset."""
    eng = llm.engine
    problems = []
    if eng.requests:
        problems.append(f"live requests left in engine.requests: {sorted(eng.requests)}")
    if eng.sched.has_work():
        problems.append(f"scheduler still has work: {len(eng.sched.waiting)} waiting, "
                        f"{len(eng.sched.running)} running")
    if getattr(eng.loop, "results", None):
        problems.append(f"{len(eng.loop.results)} unprocessed results in the overlap queue")
    if not eng.pools_full():
        problems.append(f"pools_full() is False: {eng.memory_stats()}")
    cache = eng.kv.cache
    if cache is not None:
        if cache.locked_pages:
            problems.append(f"{cache.locked_pages} radix pages still locked")
        cache.reset()
        if cache.total_pages:
            problems.append(f"{cache.total_pages} pages left in the radix cache after reset()")
    stats = eng.memory_stats()
    if eng.kv.alloc.num_free != stats["total_pages"]:
        problems.append(f"after cache reset: {eng.kv.alloc.num_free} of "
                        f"{stats['total_pages']} pages free: {stats}")
    if stats["free_slots"] != stats["total_slots"]:
        problems.append(f"{stats['free_slots']} of {stats['total_slots']} request slots free")
    return problems


# -- prompts ---------------------------------------------------------------------------


def random_prompt(n: int, seed: int, vocab: int = 49152) -> list[int]:
    """n ordinary token ids (ids below 100 are SmolLM2's special and byte tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


# Lengths straddle the page size (16), the chunk size used in tests (64) and 256.
TINY_PROMPT_LENS = (1, 3, 9, 16, 17, 40, 64, 65, 100, 150, 257)
TINY_PROMPTS: tuple[tuple[int, ...], ...] = tuple(
    tuple(random_prompt(n, seed=1000 + i)) for i, n in enumerate(TINY_PROMPT_LENS)
)
TINY_NEW_TOKENS = 24


def greedy(max_new_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kw)


def run_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.output_ids for o in llm.generate([list(p) for p in prompts], params)]


_rids = itertools.count()


def run_bounded(llm: LLM, prompts, params: SamplingParams | list[SamplingParams],
                max_steps: int = 3000):
    """Like `generate`, through the engine API, but fails instead of spinning forever when
    the scheduler stops making progress. Returns the finished requests in prompt order."""
    import pytest

    eng = llm.engine
    plist = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [eng.add_request(f"bounded-{next(_rids)}", list(p), SamplingParams(**vars(sp)))
            for p, sp in zip(prompts, plist, strict=True)]
    for _ in range(max_steps):
        if not eng.has_work():
            break
        eng.step()
    eng.loop.drain()
    if eng.has_work():
        state = [(r.state.value, len(r.prompt_ids), r.kv_len, len(r.pages), len(r.output_ids))
                 for r in reqs if not r.finished]
        stats = eng.memory_stats()
        discard_llm(llm)  # stuck for good: do not reuse it
        pytest.fail(f"engine made no progress in {max_steps} steps; unfinished requests "
                    f"(state, prompt, kv_len, pages, outputs): {state}; memory: {stats}")
    return reqs


@functools.cache
def baseline_greedy(model: str) -> tuple[tuple[int, ...], ...]:
    """Greedy outputs of TINY_PROMPTS on the default engine (overlap loop, page 16)."""
    llm = get_llm(model)
    outs = llm.generate([list(p) for p in TINY_PROMPTS],
                        greedy(TINY_NEW_TOKENS, ignore_eos=True))
    return tuple(tuple(o.output_ids) for o in outs)


# -- transformers reference (the model itself: tests/hf_reference.py, one copy) ----------


@functools.cache
def hf_greedy(model: str, prompt: tuple[int, ...], max_new_tokens: int,
              stop_at_eos: bool) -> tuple[int, ...]:
    """transformers `generate` greedy continuation of one prompt (fp32, no padding)."""
    m = hf_model(model)
    gen_cfg = m.generation_config
    saved = gen_cfg.eos_token_id
    if not stop_at_eos:
        gen_cfg.eos_token_id = None  # a generate() kwarg of None would not override it
    try:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0)
    finally:
        gen_cfg.eos_token_id = saved
    return tuple(out[0, len(prompt):].tolist())


def drop_hf_models() -> None:
    hf_greedy.cache_clear()
    hf_reference.hf_greedy.cache_clear()
    hf_model.cache_clear()
