"""Request migration (docs/architecture.md: Request lifecycles, router): when the decode
node of a request dies after the client has received k tokens, the router sends the
request again, to a fresh prefill/decode pair, as prompt + those k tokens with k fewer
tokens to go, and continues the same client stream as if nothing had happened.

Why this is exact for greedy requests: the new pair prefills prompt + k tokens and
decodes on from there, which is what the dead node would have computed next. Text is
re-derived by the router from *all* output ids (its own incremental detokenizer, seeded
with what the client has already seen), so a multi-byte character or a stop string
that straddles the migration point comes out exactly as one node would have written it.

Logprobs: the output entries of the tokens already sent are kept and the continuation's
follow them (the new pair computes them for its own tokens; greedy entries equal an unbroken
run's up to float rounding of a different batch); the prompt's entries stay the original
prompt's.

Seeded sampling: a seeded request continues with a seed derived from (seed, k), so a
migrated request is reproducible for a given failure point but draws other numbers than
an unbroken run would (the engine's generator state cannot be carried between nodes).

What counts as a decode death: the decode leg's connection broke, its stream ended
without `[DONE]` or with garbage, or it reported a server error in-band. A client error
(4xx) or a prefill-side failure is never migrated; neither is a request that already has
its finish reason (its last event made it: nothing is missing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.http.detokenizer import IncrementalDetokenizer
from pdserve.router.events import Event, StreamFormatError
from pdserve.router.legs import LegError

SEED_MASK = (1 << 63) - 1


def is_decode_death(exc: Exception, decode_node_id: str) -> bool:
    """A failure of the decode node itself, after its stream began."""
    if isinstance(exc, StreamFormatError):
        return True
    if not isinstance(exc, LegError):
        return False
    return (exc.leg == "decode" and exc.node.node_id == decode_node_id
            and exc.status >= 500)


def continuation(ids: list[int], sampling: dict, sent: Event) -> tuple[list[int], dict]:
    """Prompt and sampling of the request's continuation after `sent` (the last event the
    client received, stitched: its output ids are all ids so far)."""
    k = len(sent.output_ids)
    rest = dict(sampling)
    rest["max_new_tokens"] = int(sampling["max_new_tokens"]) - k
    # The sent tokens become prompt: the grammar, penalties and min tokens still count them.
    rest["resumed_outputs"] = int(sampling.get("resumed_outputs", 0)) + k
    if sampling.get("seed") is not None:
        rest["seed"] = (int(sampling["seed"]) * 1_000_003 + k) & SEED_MASK
    return ids + list(sent.output_ids), rest


@dataclass
class Stitcher:
    """Turns the continuation's events (ids and text relative to the new prompt) into
    events of the original request: all ids so far, text decoded by the router."""

    base: Event  # the last event the client received before this migration
    tokenizer: object  # a transformers tokenizer
    stop: list[str] = field(default_factory=list)
    _detok: IncrementalDetokenizer | None = None
    _seen: int = 0  # continuation ids already fed to the detokenizer

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer, self.stop)
        self._detok.ids = list(self.base.output_ids)
        self._detok.emitted = self.base.text

    def stitch(self, event: Event) -> Event:
        """`event` as the original request's event. A stop string the router finds
        (across the migration point) ends it with finish reason "stop"."""
        new = event.output_ids[self._seen:]
        self._seen = len(event.output_ids)
        detok = self._detok
        assert detok is not None
        delta = detok.add(new, finished=event.finish_reason is not None)
        finish = event.finish_reason or ("stop" if detok.stopped else None)
        ids = list(self.base.output_ids) + list(event.output_ids)
        return Event(event.rid, delta, detok.emitted, ids, self.base.prompt_tokens,
                     self.base.cached_tokens, finish, self._meta(event.meta))

    def _meta(self, meta: dict) -> dict:
        """The continuation's meta as the original request's: output logprob entries of
        the tokens sent before the migration, then the continuation's (one per id, as the
        ids); the prompt's entries are the original prompt's."""
        out = {**meta, "migrated": True}
        base = self.base.meta
        for key in ("output_token_logprobs", "output_top_logprobs"):
            if key in base and key in meta:
                out[key] = list(base[key]) + list(meta[key])
        for key in ("input_token_logprobs", "input_top_logprobs"):
            if key in base:
                out[key] = base[key]
            else:
                out.pop(key, None)
        return out
