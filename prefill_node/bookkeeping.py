"""Per-request send bookkeeping of the prefill role. Pure Python, testable without a model.

Pages go out in prompt order, each exactly once (docs/architecture.md, overlap scheduling
and the prefill role). A chunk's KV is valid only once its forward is done, so the send
decisions are made from records taken when the chunk is scheduled, and carried out when
that batch's result is processed (one loop later under the overlap loop):

- `chunk_scheduled(end)` records `tmp_end_idx = end` (KV is valid up to there once this
  chunk's forward is done) in a FIFO of launched chunks; a chunk ending before the prompt
  does counts one more in `inflight_middle_chunks`.
- `chunk_done()` takes the oldest launched chunk (results are processed in launch order).
  If `inflight_middle_chunks` is still positive, that result is a middle chunk: the counter
  drops by one and the pages up to its `tmp_end_idx`, floored to a page, go out. If the
  counter is already 0, every middle chunk has been processed: this is the final chunk and
  everything left goes out, the partial last page included (with the metadata row).

Under the overlap loop two chunks of one request can be in flight at once (chunk k+1 is
scheduled before chunk k's result is processed); the FIFO keeps each chunk's end, so each
result sends exactly what its own forward completed. The caller may pass the batch row's
end as a cross-check: a disagreement (a result fed out of order, or a row the bookkeeping
never saw scheduled) raises instead of sending the wrong pages.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple


class ChunkResult(NamedTuple):
    pages: range  # pages to send now (empty for a dropped result)
    last: bool  # the final chunk: send with the metadata row


class SendProgress:
    def __init__(self, prompt_len: int, page_size: int) -> None:
        self.prompt_len = prompt_len
        self.page_size = page_size
        self.sent_pages = 0  # pages [0, sent_pages) are queued on the sender
        self.tmp_end_idx = 0  # end of the newest scheduled chunk
        self.inflight_middle_chunks = 0  # launched middle chunks whose result is unprocessed
        self._launched: deque[int] = deque()  # tmp_end_idx of each launched chunk, oldest first

    @property
    def total_pages(self) -> int:
        return -(-self.prompt_len // self.page_size)

    @property
    def inflight_chunks(self) -> int:
        """Launched chunks (middle and last) whose result is not processed yet."""
        return len(self._launched)

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

    def chunk_scheduled(self, end_idx: int) -> None:
        """A chunk computing positions up to `end_idx` was built and will launch."""
        if not self.tmp_end_idx < end_idx <= self.prompt_len:
            raise RuntimeError(f"chunk end {end_idx} is not past the previous chunk end "
                               f"{self.tmp_end_idx} within the prompt ({self.prompt_len})")
        if self._launched and self._launched[-1] == self.prompt_len:
            raise RuntimeError("a chunk was scheduled after the final chunk")
        self.tmp_end_idx = end_idx
        self._launched.append(end_idx)
        if end_idx < self.prompt_len:
            self.inflight_middle_chunks += 1

    def chunk_done(self, aborted: bool, row_end: int | None = None) -> ChunkResult:
        """The oldest launched chunk's result was processed: the pages it completed (none
        if the request was aborted meanwhile: its in-flight result is dropped)."""
        if not self._launched:
            raise RuntimeError("a chunk result arrived with no launched chunk")
        end = self._launched[0]
        if row_end is not None and row_end != end:
            raise RuntimeError(f"chunk result out of order: the row ends at {row_end}, "
                               f"the oldest launched chunk at {end}")
        self._launched.popleft()
        last = self.inflight_middle_chunks == 0
        if not last:
            self.inflight_middle_chunks -= 1
        if last != (end == self.prompt_len):  # the two records must tell the same story
            raise RuntimeError(f"chunk ending at {end}: counter says last={last}")
        if aborted:
            return ChunkResult(range(0), last)
        return ChunkResult(self._take(self.total_pages if last else end // self.page_size),
                           last)

    def _take(self, end_page: int) -> range:
        pages = range(self.sent_pages, max(end_page, self.sent_pages))
        self.sent_pages = pages.stop
        return pages
