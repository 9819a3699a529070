"""Typed messages between the HTTP process and the scheduler process (msgpack on ZMQ).

Every message is a dataclass; on the wire it is a msgpack map with a `type` tag. Decoding
checks the tag and the field names, so a malformed frame raises `ValueError` instead of
building a half-valid object. Never pickle: a socket is not a trusted source.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import msgpack


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    sampling: dict  # SamplingParams fields
    leg: dict = field(default_factory=dict)  # PDLegFields.to_wire() ({}: not a PD leg)
    # The request carries a sampled trace context: the scheduler records its spans
    # (pdserve/tracing/marks.py) and ships them in `TokenUpdate.trace`.
    traced: bool = False


@dataclass
class AbortRequest:
    rid: str


@dataclass
class FlushCache:
    """Drop every prefix-cache page no request holds (SGLang's /flush_cache)."""


@dataclass
class Shutdown:
    drain: bool = False


@dataclass
class Accepted:
    rid: str


@dataclass
class Rejected:
    rid: str
    status: int  # HTTP status the front should answer with
    message: str


@dataclass
class TokenUpdate:
    rid: str
    new_ids: list[int]
    finish_reason: str | None = None
    cached_tokens: int = 0
    error: str | None = None
    error_code: str | None = None  # e.g. "prefill_failed": who is to blame
    # Only when the request asked (docs/architecture.md: Logprobs): one entry per new id,
    # [logprob, [[id, logprob], ...]] or None; prompt entries once, with the first update.
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    # Traced requests only: spans recorded since the last update, each
    # [name, start_ns, end_ns, {attribute: int | str}] (pdserve/tracing/marks.py).
    trace: list | None = None


@dataclass
class TokenBatch:
    updates: list[dict]  # TokenUpdate fields; one message per scheduler step


@dataclass
class Ready:
    model: str
    context_length: int
    vocab_size: int
    max_total_tokens: int
    page_size: int
    kv_info: dict = field(default_factory=dict)  # PD nodes: registry transfer fields
    engine_info: dict = field(default_factory=dict)  # loop choice, dtype, device, threads


@dataclass
class Stats:
    running: int
    waiting: int
    kv_usage: float
    cache_hit_rate: float
    free_pages: int
    total_pages: int
    free_slots: int
    total_slots: int
    pools_full: bool
    overlap_disabled: dict
    retractions: int
    generated_tokens: int
    mixed_batches: int = 0  # prefill batches that also advanced the running requests
    role: dict = field(default_factory=dict)  # role queues and transfer counters
    hicache: dict = field(default_factory=dict)  # host KV tier (empty when HiCache is off)
    # Stats are a snapshot sent every STATS_PERIOD_S, so /server_info can be up to one period
    # old. `seq` counts snapshots (1 = the first); `taken_at` is the scheduler's wall clock
    # (time.time()) when it was taken: a reader that must see the effect of an action it
    # finished at time T waits for `taken_at > T`, never for time to pass.
    seq: int = 0
    taken_at: float = 0.0


MESSAGES = {cls.__name__: cls for cls in (
    GenerateRequest, AbortRequest, FlushCache, Shutdown, Accepted, Rejected, TokenUpdate,
    TokenBatch, Ready, Stats)}


def encode(msg) -> bytes:
    body = asdict(msg)
    body["type"] = type(msg).__name__
    return msgpack.packb(body, use_bin_type=True)


def decode(frame: bytes):
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:
        raise ValueError(f"undecodable frame: {exc}") from exc
    if not isinstance(body, dict) or body.get("type") not in MESSAGES:
        raise ValueError("frame is not a known message")
    cls = MESSAGES[body.pop("type")]
    names = {f.name for f in fields(cls)}
    if not set(body) <= names:
        raise ValueError(f"unexpected fields for {cls.__name__}: {sorted(set(body) - names)}")
    try:
        return cls(**body)
    except TypeError as exc:
        raise ValueError(f"bad {cls.__name__}: {exc}") from exc
