"""Per-request logit processing before sampling: frequency, presence and repetition
penalties, logit_bias, min_new_tokens (docs/architecture.md: Sampling).

Two halves, one per thread:
- `logit_inputs` (scheduler thread, while packing a batch) turns the sampled rows'
  parameters into flat index/value tensors that travel with the batch's other inputs.
- `LogitProcessor` (forward thread) applies them to the logits and, after sampling,
  counts the sampled tokens.

Penalties need the counts of the tokens a request generated so far. In overlap mode the
scheduler packs batch N+1 before it knows batch N's tokens, so the counts live on the
device, one row per request slot, and the forward thread adds each sampled token right
after sampling it: batch N+1's forward runs after batch N's on the same thread, so it
always sees them. The host only says when a slot's row must be rebuilt from scratch
(`PenaltyBook`): the first time a request samples in that slot. At that moment every
output the request has is known on the host (a new request has none; a decode node's
request has its first token; a re-admitted request was retracted with nothing in flight),
so the rebuild from `output_ids` is exact. The rows stay on the device for the node's
life (lazily allocated, [slots, vocab] int32 + bool) and cost nothing for requests
without penalties.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.request import Req

# Keys of the packed batch inputs (`Batch.packed`); present only when a row processes logits.
INT_KEYS = ("lx_pen_rows", "lx_pen_slots", "lx_init_slots", "lx_count_slots",
            "lx_count_toks", "lx_seen_slots", "lx_seen_toks", "lx_ban_rows", "lx_ban_toks",
            "lx_bias_rows", "lx_bias_toks")
FLOAT_KEYS = ("lx_freq", "lx_pres", "lx_rep", "lx_bias", "lx_min_p")


class PenaltyBook:
    """Host side (scheduler thread): which request's counts each slot row holds."""

    def __init__(self) -> None:
        self._owner: dict[int, Req] = {}

    def needs_init(self, req: Req) -> bool:
        """True once per (request, slot): the device row must be rebuilt for `req`."""
        slot = req.slot
        assert slot is not None  # a request in a batch holds its slot
        if self._owner.get(slot) is req:
            return False
        self._owner[slot] = req
        return True


def logit_inputs(reqs: Sequence[Req], book: PenaltyBook
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
    """Packed inputs for the sampling rows `reqs` (row i samples for reqs[i]); None when no
    row processes its logits (the common case: nothing extra is packed or run)."""
    if not any(r.params.processes_logits for r in reqs):
        return None
    ints: dict[str, list[int]] = {k: [] for k in INT_KEYS}
    floats: dict[str, list[float]] = {k: [] for k in FLOAT_KEYS}
    for i, req in enumerate(reqs):
        p = req.params
        floats["lx_min_p"].append(p.min_p)
        if p.penalized:
            slot = req.slot
            assert slot is not None  # a request in a batch holds its request slot
            ints["lx_pen_rows"].append(i)
            ints["lx_pen_slots"].append(slot)
            floats["lx_freq"].append(p.frequency_penalty)
            floats["lx_pres"].append(p.presence_penalty)
            floats["lx_rep"].append(p.repetition_penalty)
            if book.needs_init(req):
                # A migrated request's earlier outputs end its prompt (resumed_outputs).
                outs = req.prompt_ids[len(req.prompt_ids) - p.resumed_outputs:] \
                    if p.resumed_outputs else []
                outs = outs + req.output_ids
                ints["lx_init_slots"].append(slot)
                ints["lx_count_slots"] += [slot] * len(outs)
                ints["lx_count_toks"] += outs
                ints["lx_seen_slots"] += [slot] * len(req.prompt_ids)
                ints["lx_seen_toks"] += req.prompt_ids
        # This row samples output number `launched_outputs` (counted at launch).
        if req.launched_outputs + p.resumed_outputs <= p.min_new_tokens:
            banned = set(req.eos_ids) | set(p.stop_token_ids)
            ints["lx_ban_rows"] += [i] * len(banned)
            ints["lx_ban_toks"] += sorted(banned)
        for tok, bias in (p.logit_bias or {}).items():
            ints["lx_bias_rows"].append(i)
            ints["lx_bias_toks"].append(tok)
            floats["lx_bias"].append(bias)
    return ({k: torch.tensor(v, dtype=torch.int64) for k, v in ints.items()},
            {k: torch.tensor(v, dtype=torch.float32) for k, v in floats.items()})


class LogitProcessor:
    """Device side (forward thread): the per-slot counts and the processing itself."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.num_slots, self.device = num_slots, device
        self.counts: torch.Tensor | None = None  # [slots, V] int32: outputs so far
        self.seen: torch.Tensor | None = None  # [slots, V] bool: in the prompt

    def _state(self, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.counts is None or self.counts.shape[1] != vocab:
            self.counts = torch.zeros(self.num_slots, vocab, dtype=torch.int32,
                                      device=self.device)
            self.seen = torch.zeros(self.num_slots, vocab, dtype=torch.bool, device=self.device)
        assert self.seen is not None
        return self.counts, self.seen

    def apply(self, logits: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """logits [R, V] float32 of the sampling rows -> processed copy (the raw logits
        stay as they are: logprobs report the model's distribution, as vLLM's do)."""
        if "lx_min_p" not in t:
            return logits
        x = logits.clone()
        if t["lx_bias_rows"].numel():  # before the penalties, as vLLM orders them
            x.index_put_((t["lx_bias_rows"], t["lx_bias_toks"]), t["lx_bias"], accumulate=True)
        rows = t["lx_pen_rows"]
        if rows.numel():
            counts, seen = self._state(x.shape[1])
            init = t["lx_init_slots"]
            if init.numel():
                counts[init] = 0
                seen[init] = False
                cs = t["lx_count_slots"]
                counts.index_put_((cs, t["lx_count_toks"]),
                                  torch.ones_like(cs, dtype=torch.int32), accumulate=True)
                seen[t["lx_seen_slots"], t["lx_seen_toks"]] = True
            slots = t["lx_pen_slots"]
            c = counts[slots].to(x.dtype)  # [P, V]
            sub = x[rows]
            rep = t["lx_rep"].unsqueeze(1)
            hit = seen[slots] | (c > 0)
            sub = torch.where(hit, torch.where(sub > 0, sub / rep, sub * rep), sub)
            sub = sub - t["lx_freq"].unsqueeze(1) * c - t["lx_pres"].unsqueeze(1) * (c > 0)
            x[rows] = sub
        if t["lx_ban_rows"].numel():
            x[t["lx_ban_rows"], t["lx_ban_toks"]] = float("-inf")
        return x

    def record(self, t: dict[str, torch.Tensor], tokens: torch.Tensor) -> None:
        """Count the sampled tokens [R] of the penalized rows."""
        rows = t.get("lx_pen_rows")
        if rows is None or not rows.numel():
            return
        slots = t["lx_pen_slots"]
        assert self.counts is not None  # apply() ran on these rows first
        self.counts.index_put_((slots, tokens[rows]),
                               torch.ones_like(slots, dtype=torch.int32), accumulate=True)
