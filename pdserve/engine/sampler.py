"""Token sampling on the device: greedy, temperature, min-p, top-k, top-p, per-request seeds.

A seeded request draws from its own `torch.Generator`, one draw per sampled token, so its
output does not depend on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [R] float, 0 = greedy
    top_p: torch.Tensor  # [R] float
    top_k: torch.Tensor  # [R] int, <= 0 = off
    generators: list[torch.Generator | None]  # per row; None = the engine's generator
    all_greedy: bool
    min_p: torch.Tensor | None = None  # [R] float, 0 = off; None: no row uses it


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, s: SamplingBatch) -> torch.Tensor:
        """logits [R, V] float32 -> token ids [R] int64."""
        greedy = logits.argmax(dim=-1)
        if s.all_greedy:
            return greedy
        temp = s.temperature.clamp(min=1e-5).unsqueeze(1)
        probs = torch.softmax(logits / temp, dim=-1)
        if s.min_p is not None:  # drop tokens below min_p x the most likely one's probability
            floor = s.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(probs < floor, 0.0, probs)
        probs = _top_k_top_p(probs, s.top_k, s.top_p)
        sampled = torch.empty_like(greedy)
        for i, gen in enumerate(s.generators):
            g = gen if gen is not None else self.generator
            sampled[i] = torch.multinomial(probs[i], 1, generator=g)[0]
        return torch.where(s.temperature == 0, greedy, sampled)


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, probs.shape[-1]).unsqueeze(1)
    cum_before = sorted_p.cumsum(dim=-1) - sorted_p
    keep = (rank < k) & (cum_before < top_p.unsqueeze(1))
    keep[:, 0] = True  # the most likely token always survives
    sorted_p = sorted_p * keep
    out = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return out / out.sum(dim=-1, keepdim=True)
