"""Per-request send bookkeeping of the prefill role. Pure Python, testable without a model.

Pages go out in prompt order, each exactly once. A chunk's KV is valid only once its
forward is done, so under the overlap loop the chunk's end is recorded when it is
scheduled (`tmp_end_idx`) and its pages are sent when that batch's result is processed.
Only whole pages go out with middle chunks; the partial last page goes with the last.
"""

from __future__ import annotations


class SendProgress:
    def __init__(self, prompt_len: int, page_size: int) -> None:
        self.prompt_len = prompt_len
        self.page_size = page_size
        self.sent_pages = 0  # pages [0, sent_pages) are queued on the sender
        self.tmp_end_idx = 0  # KV is valid up to here once every launched chunk is done
        self.inflight_middle_chunks = 0  # launched middle chunks whose result is unprocessed

    @property
    def total_pages(self) -> int:
        return -(-self.prompt_len // self.page_size)

    def early_send(self, cached_len: int, loading_pages: frozenset[int] = frozenset()
                   ) -> range:
        """Cached prefix pages that may go out before the suffix forward. A page still being
        loaded by the host tier is not valid yet: stop before the first such page (the rest
        goes with the deferred sends, in order)."""
        end = cached_len // self.page_size
        for p in range(self.sent_pages, end):
            if p in loading_pages:
                end = p
                break
        return self._take(end)

    def chunk_scheduled(self, end_idx: int, last: bool) -> None:
        self.tmp_end_idx = end_idx
        if not last:
            self.inflight_middle_chunks += 1

    def chunk_done(self, end_idx: int, last: bool, aborted: bool) -> range:
        """A launched chunk's result was processed: the pages it completed (none if the
        request was aborted meanwhile: its in-flight result is dropped)."""
        if not last:
            if self.inflight_middle_chunks <= 0:
                raise RuntimeError("inflight_middle_chunks would go negative")
            self.inflight_middle_chunks -= 1
        if aborted:
            return range(0)
        end = self.total_pages if last else end_idx // self.page_size
        return self._take(end)

    def _take(self, end_page: int) -> range:
        pages = range(self.sent_pages, max(end_page, self.sent_pages))
        self.sent_pages = pages.stop
        return pages
