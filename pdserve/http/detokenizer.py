"""Incremental, UTF-8-safe detokenization with stop-string hold-back (HTTP process).

Text is always the decode of all output ids so far (so the streamed pieces add up to
exactly the final text). A trailing U+FFFD means a multi-byte character is still
incomplete: it is held back. While the request runs, the last `max(len(stop)) - 1`
characters are held back too, so a stop string never leaks out half-printed.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.emitted = ""
        self.stopped = False  # a stop string was found: the text ends before it

    def add(self, new_ids: list[int], finished: bool) -> str:
        """Append ids; return the text that may be shown now (a delta)."""
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if self.stop:
            cut = [text.find(s) for s in self.stop if s in text]
            if cut:
                text, finished, self.stopped = text[: min(cut)], True, True
        if not finished:
            while text.endswith("\ufffd"):
                text = text[:-1]
            if self.hold:
                text = text[: max(len(self.emitted), len(text) - self.hold)]
        if not text.startswith(self.emitted):  # decode of a longer prefix changed: re-sync
            return ""
        delta = text[len(self.emitted):]
        self.emitted = text
        return delta
