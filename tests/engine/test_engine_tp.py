"""Tensor parallelism (docs/architecture.md: Tensor parallelism): TP2 on gloo gives the same
greedy tokens as TP1, a TP size the heads cannot take is refused before any process starts,
and worker ranks never outlive rank 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from engine_helpers import (
    TINY_MODELS,
    TINY_NEW_TOKENS,
    TINY_PROMPTS,
    baseline_greedy,
    discard_llm,
    get_llm,
    greedy,
    run_ids,
)

import pdserve
from pdserve import LLM
from pdserve.models.parallel import plan_tp

TP_VARIANTS = {
    "overlap-chunked-64": dict(chunked_prefill_size=64),
    "normal": dict(disable_overlap=True),
}


@pytest.mark.parametrize("variant", list(TP_VARIANTS))
@pytest.mark.parametrize("model", TINY_MODELS)
def test_tp2_greedy_equals_tp1(model, variant):
    # tiny-llama: 2 KV heads, one per rank; tiny-qwen2: 1 KV head, replicated on both ranks.
    base = baseline_greedy(model)
    llm = get_llm(model, tp_size=2, **TP_VARIANTS[variant])
    assert llm.engine.kv_pool.layout.num_kv_heads == 1
    outs = run_ids(llm, TINY_PROMPTS, greedy(TINY_NEW_TOKENS, ignore_eos=True))
    for i, (out, ref) in enumerate(zip(outs, base, strict=True)):
        assert out == list(ref), f"prompt {i} ({len(TINY_PROMPTS[i])} tokens)"
    # A second round reuses the prefix cache on both ranks (same page table everywhere).
    again = run_ids(llm, TINY_PROMPTS[-3:], greedy(TINY_NEW_TOKENS, ignore_eos=True))
    assert again == [list(r) for r in base[-3:]]
    assert llm.engine.describe()["tp_size"] == 2
    procs = llm.engine.tp.procs
    discard_llm(llm)  # closes the engine: its worker rank must exit
    assert all(p.poll() is not None for p in procs)


def test_tp_size_not_dividing_heads_is_refused():
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        LLM("tiny-llama", tp_size=3, max_total_tokens=1024)


def _cfg(h: int, hkv: int, inter: int = 256) -> SimpleNamespace:
    return SimpleNamespace(num_attention_heads=h, num_key_value_heads=hkv, head_dim=8,
                           hidden_size=h * 8, intermediate_size=inter, model_type="llama")


def test_plan_splits_or_replicates_kv_heads():
    # 8 q heads, 4 KV heads on 2 ranks: split, 2 KV heads each.
    p = [plan_tp(_cfg(8, 4), 2, r) for r in range(2)]
    assert [(x.q_start, x.local_heads, x.kv_start, x.local_kv_heads) for x in p] == \
        [(0, 4, 0, 2), (4, 4, 2, 2)]
    # 8 q heads, 2 KV heads on 4 ranks: each KV head on 2 ranks, next to its q heads.
    p = [plan_tp(_cfg(8, 2), 4, r) for r in range(4)]
    assert [(x.q_start, x.kv_start, x.local_kv_heads) for x in p] == \
        [(0, 0, 1), (2, 0, 1), (4, 1, 1), (6, 1, 1)]
    assert p[0].kv_replicated
    with pytest.raises(ValueError, match="cannot split the 3 KV heads"):
        plan_tp(_cfg(12, 3), 2)
    with pytest.raises(ValueError, match="MLP width"):
        plan_tp(_cfg(4, 2, inter=99), 2)


_ORPHAN = textwrap.dedent("""
    from pdserve import LLM
    llm = LLM("tiny-llama", tp_size=2, max_total_tokens=1024, dtype="float32")
    llm.generate([[5, 6, 7]])
    print(" ".join(str(p.pid) for p in llm.engine.tp.procs), flush=True)
    import time
    time.sleep(600)
""")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie is gone too (its parent, already dead, was the test's child).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_workers_exit_when_rank0_is_killed():
    env = {**os.environ, "PYTHONPATH": str(Path(pdserve.__file__).parents[1])}
    rank0 = subprocess.Popen([sys.executable, "-c", _ORPHAN], stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        line = rank0.stdout.readline()
        assert line.strip(), "rank 0 did not start"
        workers = [int(x) for x in line.split()]
        assert workers and not any(_gone(w) for w in workers)
        rank0.send_signal(signal.SIGKILL)
        rank0.wait()
        deadline = time.monotonic() + 60  # bounded wait for exit, not a timing check
        while time.monotonic() < deadline and not all(_gone(w) for w in workers):
            time.sleep(0.2)
        left = [w for w in workers if not _gone(w)]
        for w in left:
            os.kill(w, signal.SIGKILL)
        assert not left, f"TP workers {left} outlived rank 0"
    finally:
        if rank0.poll() is None:
            rank0.kill()
            rank0.wait()


def test_tp_with_hicache_refused():
    with pytest.raises(ValueError, match="hierarchical-cache does not support --tp-size"):
        LLM("tiny-llama", tp_size=2, enable_hierarchical_cache=True)


def test_dead_worker_fails_requests_with_an_error():
    llm = LLM("tiny-llama", tp_size=2, max_total_tokens=1024, dtype="float32")
    try:
        info = llm.engine.describe()["tp"]
        assert info["kv_heads_per_rank"] == 1 and [r["alive"] for r in info["ranks"]] == [
            True, True]
        worker = llm.engine.tp.procs[0]
        worker.kill()
        worker.wait()
        with pytest.raises(RuntimeError):
            llm.generate([[5, 6, 7]], greedy(4))
        reqs = list(llm.engine.requests.values())  # ended with the error, reported next step
        assert reqs and all(r.finished and r.error for r in reqs), \
            [r.error for r in reqs]
        assert llm.engine.describe()["tp"]["ranks"][1]["alive"] is False
    finally:
        llm.close()
