"""A launched batch: its rows, frozen at launch, and its packed device inputs.

The scheduler keeps changing requests after launch (in overlap mode it processes the
previous result and builds the next batch while this one runs), so everything the
forward and the result processing need is copied into this object when it is built:
`rows` is a tuple and each row records the request's lengths at launch time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.request import Req
from pdserve.engine.staging import Packed, StagingRing


@dataclass(frozen=True)
class Row:
    req: Req
    start: int  # first position computed by this batch
    q_len: int  # positions computed by this batch
    future_id: int  # where the sampled token goes; 0 = this row does not sample
    input_id: int = 0  # decode rows: the input token, or a FutureMap placeholder (< 0)


@dataclass
class Batch:
    seq: int  # launch order, used for deferred release of pages
    kind: str  # "extend" (prefill chunks) or "decode"
    rows: tuple[Row, ...]
    packed: Packed | None = None
    generators: tuple = ()
    all_greedy: bool = True
    load_barrier: int = 0  # HiCache load op whose layers the forward waits for (0: none)

    @property
    def sampled_rows(self) -> list[Row]:
        return [r for r in self.rows if r.future_id]


def pack_batch(batch: Batch, table: torch.Tensor, staging: StagingRing, page_size: int) -> None:
    """Fill `batch.packed` from the rows (scheduler thread). `table` is req->token slots."""
    rows = batch.rows
    q_lens = [r.q_len for r in rows]
    kv_lens = [r.start + r.q_len for r in rows]
    b, lq, lk = len(rows), max(q_lens), max(kv_lens)
    ids, pos, q_pos, q_index = [], [], torch.zeros(b, lq, dtype=torch.int64), []
    logit_rows, cursor = [], 0
    for i, r in enumerate(rows):
        if batch.kind == "decode":
            ids.append(r.input_id)
        else:
            ids.extend(r.req.fill_ids[r.start:r.start + r.q_len])
        pos.extend(range(r.start, r.start + r.q_len))
        q_pos[i, : r.q_len] = torch.arange(r.start, r.start + r.q_len)
        q_index.extend(range(i * lq, i * lq + r.q_len))
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
        "q_pos": q_pos,
        "q_index": torch.tensor(q_index, dtype=torch.int64),
        "logit_rows": torch.tensor(logit_rows, dtype=torch.int64),
        "future_ids": torch.tensor([r.future_id for r in sampled], dtype=torch.int64),
        "top_k": torch.tensor([p.top_k for p in params], dtype=torch.int64),
    }
    floats = {
        "temperature": torch.tensor([0.0 if p.greedy else p.temperature for p in params]),
        "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float32),
    }
    batch.generators = tuple(r.req.generator for r in sampled)
    batch.all_greedy = all(p.greedy for p in params)
    batch.packed = staging.pack(ints, floats)
