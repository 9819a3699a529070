"""A launched batch: its rows, frozen at launch, and its packed device inputs.

The scheduler keeps changing requests after launch (in overlap mode it processes the
previous result and builds the next batch while this one runs), so everything the
forward and the result processing need is copied into this object when it is built:
`rows` is a tuple and each row records the request's lengths at launch time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from pdserve.engine.grammar import GrammarGate
from pdserve.engine.logit_processing import PenaltyBook, logit_inputs
from pdserve.engine.logprobs import LogprobSpec
from pdserve.engine.request import Req
from pdserve.engine.staging import Packed, StagingRing

# extend: prompt chunks (prefill), possibly followed by decode rows (a mixed batch);
# decode: one token for each running request
BatchKind = Literal["extend", "decode"]


@dataclass(frozen=True)
class Row:
    req: Req
    start: int  # first position computed by this batch
    q_len: int  # positions computed by this batch
    future_id: int  # where the sampled token goes; 0 = this row does not sample
    input_id: int = 0  # decode rows: the input token, or a FutureMap placeholder (< 0)
    decode: bool = False  # one generated token as input (not prompt positions)


@dataclass
class Batch:
    seq: int  # launch order, used for deferred release of pages
    kind: BatchKind
    rows: tuple[Row, ...]
    packed: Packed | None = None
    generators: tuple = ()
    all_greedy: bool = True
    load_barrier: int = 0  # HiCache load op whose layers the forward waits for (0: none)
    lp: LogprobSpec | None = None  # None: no row asked for logprobs (nothing extra computed)
    processes_logits: bool = False  # a row has penalties, logit_bias, min tokens or min_p
    uses_min_p: bool = False
    grammar: GrammarGate | None = None  # the mask of its structured-output rows

    @property
    def sampled_rows(self) -> list[Row]:
        return [r for r in self.rows if r.future_id]

    @property
    def num_decode_rows(self) -> int:
        """Decode rows come last in a batch (a mixed batch: extend rows, then decode rows)."""
        return sum(r.decode for r in self.rows)


def pack_batch(batch: Batch, table: torch.Tensor, staging: StagingRing, page_size: int,
               penalties: PenaltyBook) -> None:
    """Fill `batch.packed` from the rows (scheduler thread). `table` is req->token slots."""
    rows = batch.rows
    q_lens = [r.q_len for r in rows]
    kv_lens = [r.start + r.q_len for r in rows]
    lk = max(kv_lens)
    ids: list[int] = []
    pos: list[int] = []
    logit_rows, cursor = [], 0
    plp_rows: list[int] = []  # prompt logprob rows: index into the batch's tokens
    plp_targets: list[int] = []  # ... and the prompt token each one predicts
    plp_counts: list[int] = []
    for r in rows:
        if r.decode:
            ids.append(r.input_id)
        else:
            ids.extend(r.req.fill_ids[r.start:r.start + r.q_len])
        pos.extend(range(r.start, r.start + r.q_len))
        if not r.decode and r.req.wants_prompt_logprobs():
            plp_counts.append(_prompt_lp_rows(r, cursor, plp_rows, plp_targets))
        else:
            plp_counts.append(0)
        cursor += r.q_len
        if r.future_id:
            logit_rows.append(cursor - 1)
    slot_idx = torch.tensor([r.req.slot for r in rows], dtype=torch.int64)
    # Slot of position i is page(i // ps) * ps + i % ps: every ps-th slot names a page.
    kv_pages = table[slot_idx, : -(-lk // page_size) * page_size : page_size] // page_size
    positions = torch.tensor(pos, dtype=torch.int64)
    out_cache_loc = table[slot_idx.repeat_interleave(torch.tensor(q_lens)), positions]
    sampled = batch.sampled_rows
    params = [r.req.params for r in sampled]
    ints = {
        "input_ids": torch.tensor(ids, dtype=torch.int64),
        "positions": positions,
        "out_cache_loc": out_cache_loc,
        "kv_pages": kv_pages,
        "logit_rows": torch.tensor(logit_rows, dtype=torch.int64),
        "future_ids": torch.tensor([r.future_id for r in sampled], dtype=torch.int64),
        "top_k": torch.tensor([p.top_k for p in params], dtype=torch.int64),
    }
    floats = {
        "temperature": torch.tensor([0.0 if p.greedy else p.temperature for p in params]),
        "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float32),
    }
    batch.lp = _logprob_spec(params, rows, plp_counts)
    if batch.lp is not None:
        ints["plp_rows"] = torch.tensor(plp_rows, dtype=torch.int64)
        ints["plp_targets"] = torch.tensor(plp_targets, dtype=torch.int64)
    if (lx := logit_inputs([r.req for r in sampled], penalties)) is not None:
        ints |= lx[0]
        floats |= lx[1]
        batch.processes_logits = True
        batch.uses_min_p = any(p.min_p > 0 for p in params)
    batch.generators = tuple(r.req.generator for r in sampled)
    batch.all_greedy = all(p.greedy for p in params)
    batch.packed = staging.pack(ints, floats)


def _prompt_lp_rows(r: Row, base: int, rows: list[int], targets: list[int]) -> int:
    """Add the chunk's positions p whose logits give prompt token p+1's logprob (those not
    packed before: a re-prefill after retraction computes none again). `base`: the index of
    the row's first token in the batch. Returns how many were added."""
    req = r.req
    first = max(r.start, req.prompt_lp_packed)
    last = min(r.start + r.q_len, len(req.prompt_ids) - 1)
    for p in range(first, last):
        rows.append(base + p - r.start)
        targets.append(req.prompt_ids[p + 1])
    req.prompt_lp_packed = max(req.prompt_lp_packed, last)
    return max(0, last - first)


def _logprob_spec(params: list, rows: tuple[Row, ...], plp_counts: list[int]
                  ) -> LogprobSpec | None:
    asked = [p.logprobs for p in params if p.logprobs is not None]
    if not asked and not any(plp_counts):
        return None
    prompt_k = max((r.req.params.prompt_logprobs or 0 for r, n in zip(rows, plp_counts,
                                                                       strict=True) if n),
                   default=0)
    return LogprobSpec(bool(asked), max(asked, default=0), prompt_k, tuple(plp_counts))
