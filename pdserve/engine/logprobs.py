"""Log-probabilities of sampled and prompt tokens (docs/architecture.md: Logprobs).

Definition (vLLM's default, `logprobs_mode=raw_logprobs`): the log-softmax of the model's
raw float32 logits at that position, *before* temperature, top-k and top-p. So a token's
logprob does not depend on the sampling settings, greedy and sampled requests report the
same numbers, and they equal `torch.log_softmax(hf_logits, -1)` of transformers.

Cost: nothing when no request of a batch asks. When one does, the batch packs
`LogprobSpec` (what to compute) and the forward returns a `LogprobOutput` next to the
sampled tokens:
- sampled rows [R]: logprob of the sampled token, plus the `top_k` best (ids, logprobs)
  with `top_k` the largest any row of the batch asked for (rows trim to their own k);
- prompt rows [P]: the logits at prompt position p give the logprob of prompt token p+1
  (the first prompt token has none), plus the top `prompt_top_k` alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.sampling_params import MAX_LOGPROBS  # noqa: F401  (OpenAI's limit)

# One token's entry: (logprob of the token itself, [(alternative id, its logprob), ...]).
TokenLogprob = tuple[float, list[tuple[int, float]]]


@dataclass(frozen=True)
class LogprobSpec:
    """What one batch computes. Built on the scheduler thread, read by the forward."""

    sampled: bool  # any sampled row asked for output logprobs
    top_k: int  # alternatives per sampled row (max over the rows that asked)
    prompt_top_k: int  # alternatives per prompt row (max over the rows that asked)
    prompt_counts: tuple[int, ...]  # per batch row: prompt logprob positions it packed


@dataclass
class LogprobOutput:
    """One batch's logprobs; tensors on the device, then on the host."""

    sampled: torch.Tensor | None = None  # [R] float32
    top_ids: torch.Tensor | None = None  # [R, K] int64
    top_lps: torch.Tensor | None = None  # [R, K] float32
    prompt: torch.Tensor | None = None  # [P] float32
    prompt_top_ids: torch.Tensor | None = None  # [P, Kp] int64
    prompt_top_lps: torch.Tensor | None = None  # [P, Kp] float32

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if v is not None}

    def to_host(self, non_blocking: bool = False) -> LogprobOutput:
        """Host copy; with `non_blocking` into pinned memory (the caller records an event)."""
        out = LogprobOutput()
        for name, t in self.tensors().items():
            if non_blocking:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
            else:
                host = t.to("cpu")
            setattr(out, name, host)
        return out

    def sampled_entries(self) -> list[TokenLogprob]:
        return _entries(self.sampled, self.top_ids, self.top_lps)

    def prompt_entries(self) -> list[TokenLogprob]:
        return _entries(self.prompt, self.prompt_top_ids, self.prompt_top_lps)


def _entries(lp, ids, lps) -> list[TokenLogprob]:
    if lp is None:
        return []
    values = lp.tolist()
    if ids is None or ids.shape[-1] == 0:
        return [(v, []) for v in values]
    tops = [list(zip(i, p, strict=True)) for i, p in zip(ids.tolist(), lps.tolist(),
                                                          strict=True)]
    return list(zip(values, tops, strict=True))


def _gather(logits: torch.Tensor, targets: torch.Tensor, k: int):
    """logits [N, V] float32, targets [N] -> (logprob of target [N], top ids, top lps)."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, targets.view(-1, 1)).view(-1)
    if k <= 0:
        return chosen, None, None
    top_lps, top_ids = logp.topk(k, dim=-1)
    return chosen, top_ids, top_lps


def compute(spec: LogprobSpec, sample_logits: torch.Tensor, tokens: torch.Tensor,
            prompt_logits: torch.Tensor, prompt_targets: torch.Tensor) -> LogprobOutput:
    """Device work of one batch: `sample_logits` [R, V] with the sampled `tokens` [R];
    `prompt_logits` [P, V] with the prompt tokens they predict, `prompt_targets` [P]."""
    out = LogprobOutput()
    if spec.sampled and sample_logits.shape[0]:
        out.sampled, out.top_ids, out.top_lps = _gather(sample_logits, tokens, spec.top_k)
    if prompt_logits.shape[0]:
        out.prompt, out.prompt_top_ids, out.prompt_top_lps = _gather(
            prompt_logits, prompt_targets, spec.prompt_top_k)
    return out


def trim(entry: TokenLogprob, k: int) -> TokenLogprob:
    """A row's own number of alternatives (the batch computed the largest k)."""
    return (entry[0], entry[1][:k])
