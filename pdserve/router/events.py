"""The decode leg's stream, read back: SSE lines -> events.

A node's /generate stream (pdserve/node/api.py) sends `data: {"text", "output_ids",
"meta_info"}` with *cumulative* text and ids, an in-band `data: {"error": {...}}` when
the request fails after its 200 header, and `data: [DONE]` at the end. `Event` has the
attributes pdserve.http.openai_format's chunk writers read, so the router formats
OpenAI streams with the node's own code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.http.logprob_format import output_entries, prompt_entries
from pdserve.http.sse import DONE, SSEFormatError, parse_data_line

# One SSE reader for the whole project (pdserve/http/sse.py); the router's names for it.
StreamFormatError = SSEFormatError  # the node sent something that is not its SSE protocol
parse_line = parse_data_line
__all__ = ["DONE", "Event", "StreamFormatError", "parse_line", "to_event"]


@dataclass
class Event:
    rid: str
    delta: str  # text new since the previous event
    text: str
    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str | None
    meta: dict = field(default_factory=dict)  # the node's meta_info, verbatim

    @property
    def output_logprobs(self) -> list | None:
        return output_entries(self.meta)

    @property
    def prompt_logprobs(self) -> list | None:
        return prompt_entries(self.meta)

    def generate_obj(self) -> dict:
        """The /generate body: the node's, with the router's request id."""
        meta = {**self.meta, "id": self.rid, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": len(self.output_ids),
                "cached_tokens": self.cached_tokens, "finish_reason": self.finish_reason}
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": meta}


def to_event(rid: str, obj: dict, previous: Event | None) -> Event:
    try:
        meta = obj["meta_info"]
        text, ids = obj["text"], obj["output_ids"]
        prompt_tokens = int(meta["prompt_tokens"])
    except (KeyError, TypeError, ValueError) as exc:
        raise StreamFormatError(f"event without text/output_ids/meta_info: {exc!r}") from exc
    before = previous.text if previous else ""
    # Text only grows (the node holds back incomplete UTF-8 and stop-string candidates).
    delta = text[len(before):] if text.startswith(before) else text
    return Event(rid, delta, text, list(ids), prompt_tokens, int(meta.get("cached_tokens") or 0),
                 meta.get("finish_reason"), meta)
