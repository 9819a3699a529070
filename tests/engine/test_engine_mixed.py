"""Mixed batches (docs/architecture.md: Scheduling policy): a prefill batch also carries one
decode row per running request. The scheduler's composition is checked without a model;
the model runs check that mixing changes no token and that decode rows and prompt rows of
one batch attend exactly as they would apart."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import (
    TINY_MODELS,
    TINY_NEW_TOKENS,
    TINY_PROMPTS,
    baseline_greedy,
    get_llm,
    greedy,
    pool_problems,
    run_ids,
)

from pdserve.config import EngineConfig
from pdserve.engine.future_map import FutureMap
from pdserve.engine.kv_manager import KVManager
from pdserve.engine.request import Req
from pdserve.engine.role import Role
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.staging import StagingRing
from pdserve.memory.kv_pool import KVLayout, KVPool
from pdserve.memory.req_to_token import ReqToTokenPool
from pdserve.models.llama import AttnMeta
from pdserve.sampling_params import SamplingParams

CPU = torch.device("cpu")


def _sched(**cfg) -> Scheduler:
    c = EngineConfig(**{"max_prefill_tokens": 64, "chunked_prefill_size": 32, **cfg})
    pool = KVPool(KVLayout(1, 1, 16, torch.float32, 4), 64, CPU)
    kv = KVManager(pool, ReqToTokenPool(9, 256), use_cache=False)
    return Scheduler(c, kv, FutureMap(8, CPU), StagingRing(CPU), Role())


def _next(sched: Scheduler):
    """next_batch, then what the forward thread does first: take the inputs out of the
    staging ring (it holds two batches; a third pack waits for the oldest to be copied)."""
    batch = sched.next_batch(in_flight=True)
    batch.packed.to_device(CPU)
    return batch


def _req(sched: Scheduler, rid: str, n: int) -> Req:
    req = Req(rid, list(range(1, n + 1)), SamplingParams(max_new_tokens=8), [])
    sched.add(req)
    return req


def test_prefill_batch_carries_the_running_requests_decode_rows():
    s = _sched()
    a = _req(s, "a", 10)
    first = _next(s)
    assert first.kind == "extend" and [r.req for r in first.rows] == [a]
    b = _req(s, "b", 40)  # 40 > chunk 32: its prefill takes two batches
    mixed = _next(s)
    assert [(r.req.rid, r.decode) for r in mixed.rows] == [("b", False), ("a", True)]
    dec = mixed.rows[-1]
    assert dec.start == 10 and dec.q_len == 1 and dec.input_id < 0  # a's future token
    assert mixed.num_decode_rows == 1 and s.num_mixed_batches == 1
    # b's last chunk rides with a's decode row; b itself gets no decode row in that batch
    # (its input would be this very batch's output).
    last = _next(s)
    assert [(r.req.rid, r.decode, r.q_len) for r in last.rows] == [
        ("b", False, 8), ("a", True, 1)]
    assert last.rows[0].future_id and b.launched_outputs == 1
    after = _next(s)
    assert after.kind == "decode" and {r.req.rid for r in after.rows} == {"a", "b"}
    assert s.num_mixed_batches == 2


def test_disabled_mixing_keeps_prefill_and_decode_apart():
    s = _sched(disable_mixed_batches=True)
    _req(s, "a", 10)
    _next(s)
    _req(s, "b", 20)
    batch = _next(s)
    assert [r.req.rid for r in batch.rows] == ["b"] and not batch.num_decode_rows
    assert s.num_mixed_batches == 0


def test_decode_rows_count_against_the_token_budget_but_leave_half():
    s = _sched(max_prefill_tokens=8, chunked_prefill_size=8, max_running_requests=8)
    for i in range(6):
        _req(s, f"r{i}", 1)
    _next(s)  # six one-token prompts, all prefilled
    _req(s, "long", 30)
    batch = _next(s)
    assert batch.rows[0].req.rid == "long"
    assert batch.rows[0].q_len == 4  # max(8 - 6 decode rows, 8 / 2)
    assert batch.num_decode_rows == 6


@pytest.mark.parametrize("model", TINY_MODELS)
@pytest.mark.parametrize("loop", ["overlap", "normal"])
def test_mixed_batches_change_no_token(model, loop):
    """Small chunks and budget: prompts prefill over many batches while earlier ones decode,
    so most batches are mixed; the tokens equal the unmixed engine's and the baseline's."""
    kw = dict(chunked_prefill_size=24, max_prefill_tokens=40, loop=loop)
    mixed = get_llm(model, **kw)
    apart = get_llm(model, disable_mixed_batches=True, **kw)
    params = greedy(TINY_NEW_TOKENS, ignore_eos=True)
    outs = run_ids(mixed, TINY_PROMPTS, params)
    assert mixed.engine.sched.num_mixed_batches > 0
    assert apart.engine.sched.num_mixed_batches == 0
    assert outs == run_ids(apart, TINY_PROMPTS, params)
    assert outs == [list(r) for r in baseline_greedy(model)]
    assert not pool_problems(mixed) and not pool_problems(apart)


def _meta(rows: list[tuple[int, int]], tables: list[torch.Tensor], ps: int, paged: bool
          ) -> tuple[AttnMeta, torch.Tensor]:
    """AttnMeta and positions for rows (start, new tokens) whose pages are `tables[i]`,
    grouped as the model runner groups them: one-token rows last go to the paged kernel."""
    n_dec = 0
    while paged and n_dec < len(rows) and rows[len(rows) - 1 - n_dec][1] == 1:
        n_dec += 1
    sdpa = rows[:len(rows) - n_dec]
    slots, pos = [], []
    for (start, n), table in zip(rows, tables, strict=True):
        p = torch.arange(start, start + n)
        pos.append(p)
        slots.append(table[p // ps] * ps + p % ps)
    width = max(len(t) for t in tables)
    pages = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in tables])
    b = len(sdpa)
    fresh = bool(sdpa) and all(start == 0 for start, _ in sdpa)
    meta = AttnMeta(
        out_cache_loc=torch.cat(slots), kv_pages=pages[:b], batch=b, page_size=ps,
        fresh_lens=tuple(n for _, n in sdpa) if fresh else None,
        extend_starts=tuple(s for s, _ in sdpa) if sdpa and not fresh else None,
        extend_lens=tuple(n for _, n in sdpa) if sdpa and not fresh else None,
        seq_lens=torch.tensor([s + 1 for s, _ in rows[b:]]) if n_dec else None,
        # as the model runner: the decode rows' pages up to their own longest context
        decode_pages=pages[b:, :-(-max(s + 1 for s, _ in rows[b:]) // ps)] if n_dec else None)
    return meta, torch.cat(pos)


def _tables(rows: list[tuple[int, int]], ps: int) -> list[torch.Tensor]:
    """Disjoint pages for each row's whole context (page 0 unused), as the allocator gives."""
    tables, first = [], 1
    for start, n in rows:
        tables.append(torch.arange(first, first + -(-(start + n) // ps)))
        first += len(tables[-1])
    return tables


def _run(model, layout, rows, ids, together: bool) -> torch.Tensor:
    """Logits of every new token of `rows`; each row's prefix is prefilled first."""
    ps = layout.page_size
    pool = KVPool(layout, 64, CPU)
    paged = model.paged_decode()
    tables = _tables(rows, ps)
    for i, (start, _) in enumerate(rows):
        if start:
            meta, pos = _meta([(0, start)], [tables[i]], ps, paged)
            model(ids[i][:start], pos, meta, pool, torch.tensor([start - 1]))
    if together:
        meta, pos = _meta(rows, tables, ps, paged)
        new = torch.cat([ids[i][s:s + n] for i, (s, n) in enumerate(rows)])
        return model(new, pos, meta, pool, torch.arange(len(new)))
    outs = []
    for i, (start, n) in enumerate(rows):
        meta, pos = _meta([(start, n)], [tables[i]], ps, paged)
        outs.append(model(ids[i][start:start + n], pos, meta, pool, torch.arange(n)))
    return torch.cat(outs)


def test_mixed_attention_equals_separate_forwards():
    """One forward over [a chunk that continues a prefix, a fresh prompt, two decode rows]
    gives the logits of running each row alone (the paged kernel when it is built)."""
    llm = get_llm("tiny-llama")
    model, layout = llm.engine.loaded.model, llm.engine.layout
    rows = [(5, 7), (0, 9), (13, 1), (30, 1)]
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(5, 200, (s + n,), generator=g) for s, n in rows]
    together = _run(model, layout, rows, ids, together=True)
    alone = _run(model, layout, rows, ids, together=False)
    assert together.shape == (7 + 9 + 1 + 1, alone.shape[1])
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-4)


def test_config_flag_is_visible():
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert "disable_mixed_batches" in names


def test_torch_attention_never_pads_decode_rows_to_a_chunk(monkeypatch):
    """Without paged kernels (torch ops), a mixed batch's decode rows gather only their own
    pages: no SDPA call's score tensor [B, H, Lq, Lk] exceeds one chunk row over the long
    prompt's context, where padding 8 decode rows to the chunk would make it 9x that. The
    tokens equal the unmixed engine's."""
    from engine_helpers import random_prompt

    chunk, long_len, ps = 64, 400, 16
    kw = {"kernels": "torch", "chunked_prefill_size": chunk, "page_size": ps}
    mixed, apart = get_llm(**kw), get_llm(disable_mixed_batches=True, **kw)
    vocab = mixed.engine.loaded.hf_config.vocab_size
    prompts = [random_prompt(16, seed=300 + i, vocab=vocab) for i in range(8)]
    prompts.append(random_prompt(long_len, seed=399, vocab=vocab))
    params = greedy(24, ignore_eos=True)
    want = run_ids(apart, prompts, params)

    scores: list[int] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        scores.append(q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2])
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    mixed_before = mixed.engine.sched.num_mixed_batches
    got = run_ids(mixed, prompts, params)
    monkeypatch.undo()
    assert mixed.engine.sched.num_mixed_batches > mixed_before
    assert got == want
    heads = mixed.engine.loaded.hf_config.num_attention_heads
    one_chunk_row = heads * chunk * -(-long_len // ps) * ps
    assert scores and max(scores) <= one_chunk_row, (max(scores), one_chunk_row)
    assert not pool_problems(mixed) and not pool_problems(apart)


def test_torch_prompt_rows_cost_the_sum_of_their_lengths(monkeypatch):
    """Without a paged prompt kernel (torch ops), prompt rows over a cached context (a long
    chunk, short prefix hits) attend row by row, each over its own context: one layer's
    SDPA score elements are H * sum(n_i * L_i) for the prompt rows plus the decode rows'
    own contexts, where padding every row to the longest would be H * B * max n * max L
    (here 9x more). The logits equal running each row alone."""
    llm = get_llm("tiny-llama", kernels="torch")
    model, layout = llm.engine.loaded.model, llm.engine.layout
    assert not model.paged_extend() and not model.paged_decode()
    ps, heads = layout.page_size, llm.engine.loaded.hf_config.num_attention_heads
    rows = [(320, 64), (20, 4), (40, 3), (8, 5), (50, 1), (70, 1)]  # (cached, new)
    g = torch.Generator().manual_seed(11)
    ids = [torch.randint(5, 200, (s + n,), generator=g) for s, n in rows]
    alone = _run(model, layout, rows, ids, together=False)

    scores: list[int] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        scores.append(q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2])
        return sdpa(q, k, v, *args, **kwargs)

    pool = KVPool(layout, 64, CPU)
    tables = _tables(rows, ps)
    for i, (start, _) in enumerate(rows):  # each row's cached context, written first
        meta, pos = _meta([(0, start)], [tables[i]], ps, False)
        model(ids[i][:start], pos, meta, pool, torch.tensor([start - 1]))
    meta, pos = _meta(rows, tables, ps, True)
    new = torch.cat([ids[i][s:s + n] for i, (s, n) in enumerate(rows)])
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    together = model(new, pos, meta, pool, torch.arange(len(new)))
    monkeypatch.undo()
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-4)

    layers = llm.engine.loaded.hf_config.num_hidden_layers
    assert len(scores) % layers == 0
    per_layer = sum(scores) // layers
    prompt = [(s, n) for s, n in rows if n > 1]
    decode = [s + 1 for s, n in rows if n == 1]
    exact = heads * (sum(n * (s + n) for s, n in prompt)
                     + len(decode) * -(-max(decode) // ps) * ps)  # decode rows: own pages
    assert per_layer == exact, (per_layer, exact)
    padded = heads * len(prompt) * max(n for _, n in prompt) * max(s + n for s, n in prompt)
    assert padded > 3 * exact
