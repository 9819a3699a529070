"""The profile of one node: measured points, the cost models fitted to them, and the JSON file.

Cost models (seconds; each step also pays the serving path's per-step cost and each
request its fixed cost, both measured through real processes by `profile_http.py`: a
colocated node's, and a PD stack's for decode steps and PD requests), all fitted by least
squares on the points `pdserve profile` measured with the real engine
(docs/architecture.md: Capacity planning):
- extend (prefill) step: `p0 + p1 * tokens + p2 * attn`, where `tokens` is the batch's new
  tokens and `attn = sum(q_len * kv_len) / 1e6` over its rows (the attention term that makes
  later chunks of a long prompt dearer than the first);
- decode step: `d0 + d1 * batch + d2 * ctx / 1e3`, `ctx` the sum of context lengths;
- KV transfer of n tokens: `t0 + n * bytes_per_token / bandwidth`.
A coefficient that comes out negative (noise on a flat curve) is dropped and the rest refit.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pdserve.config import EngineConfig

PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile file that cannot be used (missing, malformed, or for another setup)."""


def fit_nonneg(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares y ≈ x @ c with c >= 0, by dropping negative columns and refitting
    (enough for 2-3 columns of physically non-negative costs)."""
    cols = list(range(x.shape[1]))
    while True:
        c, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if (c >= 0).all() or len(cols) == 1:
            out = [0.0] * x.shape[1]
            for i, v in zip(cols, c, strict=True):
                out[i] = max(0.0, float(v))
            return out
        cols.pop(int(np.argmin(c)))


@dataclass
class Profile:
    model: str
    page_size: int
    engine: dict  # EngineConfig fields the profile ran with (chunk, budgets, max running)
    kv_bytes_per_token: int
    kv_pool_tokens: int  # KV capacity of one node at `engine["kv_cache_mb"]`
    torch_threads: int
    cpu_count: int
    transfer_backend: str
    prefill_coef: list[float]  # p0, p1, p2
    decode_coef: list[float]  # d0, d1, d2
    transfer_latency_s: float
    transfer_gbps: float  # bytes / s / 1e9
    request_overhead_s: float = 0.0  # a node's HTTP path, added to TTFT (0: not measured)
    step_overhead_s: float = 0.0  # a node's per-step serving cost (token emission, detok)
    # the same through a 1P1D stack behind the router (None: not measured, use the above):
    # router hop, both legs, bootstrap handshake, commit poll, tokens streamed via the router
    pd_request_overhead_s: float | None = None
    pd_step_overhead_s: float | None = None  # per decode step of a PD decode node
    # measured TTFTs less their median (the path's own jitter: polls, event loops); each
    # simulated request draws one, so a single request's TTFT spread shows in p90
    request_jitter_s: list[float] = field(default_factory=list)
    pd_request_jitter_s: list[float] = field(default_factory=list)
    # measured TPOTs less their median: one request's decode runs slower or faster than
    # another's on an idle node too (other processes, event loops); each simulated request
    # draws one per-token offset, so that spread shows in the TPOT p90
    tpot_jitter_s: list[float] = field(default_factory=list)
    pd_tpot_jitter_s: list[float] = field(default_factory=list)
    # step slowdown with k = 0, 1, ... other runnable threads on the node's machine
    # (profile_contention.py); [1.0]: not measured (the simulator shares cores linearly)
    contention: list[float] = field(default_factory=lambda: [1.0])
    background_load: float = 0.0  # runnable threads of other processes while profiling
    points: dict = field(default_factory=dict)  # raw measurements, for the record
    version: int = PROFILE_VERSION

    def engine_knobs(self) -> dict:
        """`engine` completed with EngineConfig's defaults: a knob the profile does not
        record was the engine's default when it ran."""
        return {**vars(EngineConfig()), **self.engine}

    # -- cost models ------------------------------------------------------------------
    def extend_s(self, tokens: float, attn_pairs: float) -> float:
        p0, p1, p2 = self.prefill_coef
        return p0 + p1 * tokens + p2 * attn_pairs / 1e6 + self.step_overhead_s

    def decode_s(self, batch: float, ctx_sum: float, pd: bool = False) -> float:
        """One decode step; `pd`: on a PD decode node (its tokens stream via the router)."""
        d0, d1, d2 = self.decode_coef
        return d0 + d1 * batch + d2 * ctx_sum / 1e3 + self.step_overhead(pd)

    def mixed_s(self, tokens: float, attn_pairs: float, batch: float, ctx_sum: float) -> float:
        """An extend step that also carries `batch` decode rows (the engine's mixed batch):
        each row is one more row of the extend's products (a prompt token's cost) plus its
        attention over its context (the decode model's); the decode step's fixed part, the
        weights' read, is the extend's already."""
        _d0, _d1, d2 = self.decode_coef
        return (self.extend_s(tokens, attn_pairs) + self.prefill_coef[1] * batch
                + d2 * ctx_sum / 1e3)

    def step_overhead(self, pd: bool) -> float:
        """Per-step serving cost of a decode step on a PD decode node (`pd`) or else."""
        return self.pd_step_overhead_s if pd and self.pd_step_overhead_s is not None \
            else self.step_overhead_s

    def request_overhead(self, pd: bool) -> float:
        """Fixed cost a request adds to TTFT (and E2E) on a PD stack (`pd`) or a node."""
        return self.pd_request_overhead_s if pd and self.pd_request_overhead_s is not None \
            else self.request_overhead_s

    def request_overheads(self, pd: bool, n: int, seed: int) -> np.ndarray:
        """What each of `n` requests adds to TTFT: the overhead plus a jitter drawn from the
        measured ones (none measured: the overhead alone), never below 0. The draws depend
        on `seed` only, so both simulators give a request the same one."""
        over = self.request_overhead(pd)
        jit = self.pd_request_jitter_s if pd and self.pd_request_overhead_s is not None \
            else self.request_jitter_s
        if not jit:
            return np.full(n, over)
        draw = np.random.default_rng([seed, 0x6A17]).integers(0, len(jit), size=n)
        return np.maximum(0.0, over + np.asarray(jit)[draw])

    def token_jitters(self, pd: bool, n: int, seed: int) -> np.ndarray:
        """What each of `n` requests adds to every output token after the first (seconds,
        < 0 for a faster one): a draw from the measured TPOT jitters (none measured: 0).
        Depends on `seed` only, so both simulators give a request the same one."""
        jit = self.pd_tpot_jitter_s if pd and self.pd_step_overhead_s is not None \
            else self.tpot_jitter_s
        if not jit:
            return np.zeros(n)
        draw = np.random.default_rng([seed, 0x7B0F]).integers(0, len(jit), size=n)
        return np.asarray(jit, dtype=float)[draw]

    def with_token_jitter(self, pd: bool, seed: int, osl: np.ndarray, first: np.ndarray,
                          e2e: np.ndarray) -> np.ndarray:
        """`e2e` with each request's token jitter over its later tokens (never before its
        first token)."""
        extra = self.token_jitters(pd, len(osl), seed) * np.maximum(osl - 1, 0)
        with np.errstate(invalid="ignore"):
            return np.maximum(e2e + extra, first)

    def slowdown(self, extra_threads: float) -> float | None:
        """Step time with `extra_threads` other runnable threads on the machine over the
        profiled step time (which already had `background_load` of them): the measured
        curve at the difference, linear between its points and with the last slope beyond;
        1 below the profile's background (its best-of-N step times are already the least
        disturbed ones); None when not measured."""
        c = self.contention
        if len(c) < 2:
            return None
        x = max(0.0, extra_threads - self.background_load)
        if x <= len(c) - 1:
            return float(np.interp(x, range(len(c)), c))
        return c[-1] + (c[-1] - c[-2]) * (x - len(c) + 1)

    def transfer_s(self, tokens: float) -> float:
        return self.transfer_latency_s + tokens * self.kv_bytes_per_token / (
            self.transfer_gbps * 1e9)

    # -- file ----------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            doc = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ProfileError(f"cannot read profile {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ProfileError(f"profile {path} is not JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("version") != PROFILE_VERSION:
            raise ProfileError(f"profile {path}: not a pdserve profile version "
                               f"{PROFILE_VERSION} (run `pdserve profile` again)")
        try:
            prof = cls(**doc)
        except TypeError as exc:
            raise ProfileError(f"profile {path}: {exc}") from None
        prof.check()
        return prof

    def check(self) -> None:
        if len(self.prefill_coef) != 3 or len(self.decode_coef) != 3:
            raise ProfileError("profile: prefill_coef and decode_coef need 3 numbers each")
        jit = [*self.request_jitter_s, *self.pd_request_jitter_s, *self.tpot_jitter_s,
               *self.pd_tpot_jitter_s]
        if any(not isinstance(v, (int, float)) or not math.isfinite(v) for v in jit):
            raise ProfileError("profile: request and TPOT jitters must be finite numbers")
        nums = [*self.prefill_coef, *self.decode_coef, self.transfer_latency_s,
                self.request_overhead_s, self.step_overhead_s, self.background_load,
                *(v for v in (self.pd_request_overhead_s, self.pd_step_overhead_s)
                  if v is not None)]
        if any(not isinstance(v, (int, float)) or v < 0 for v in nums):
            raise ProfileError("profile: cost coefficients must be numbers >= 0")
        if self.transfer_gbps <= 0 or self.kv_pool_tokens <= 0 or self.page_size < 1:
            raise ProfileError("profile: transfer_gbps, kv_pool_tokens, page_size must be > 0")
        c = self.contention
        if (not c or c[0] != 1.0 or any(not isinstance(v, (int, float)) for v in c)
                or any(c[i + 1] < c[i] for i in range(len(c) - 1))):
            raise ProfileError("profile: contention must start at 1.0 and not decrease")
        if self.extend_s(1, 0) <= 0 or self.decode_s(1, 0) <= 0:
            raise ProfileError("profile: step cost models must be > 0")

    def expect(self, model: str | None, page_size: int | None) -> None:
        """Refuse a profile measured for another model or page size than the plan's."""
        if model and model != self.model:
            raise ProfileError(f"profile is for model {self.model!r}, not {model!r}; "
                               "profile that model first")
        if page_size and page_size != self.page_size:
            raise ProfileError(f"profile was measured with page size {self.page_size}, not "
                               f"{page_size}; profile again with --page-size {page_size}")
