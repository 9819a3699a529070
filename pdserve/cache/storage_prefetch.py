"""Storage prefetch: a waiting request's prefix read from the storage tier into host pages,
off the scheduler thread (docs/architecture.md: HiCache storage).

A lookup and a read take a network round trip per page with Mooncake Store, or a file read
per page: milliseconds to tens of milliseconds for a long prompt. Done inline at admission
they would stall every running decode for that long. So a waiting request whose prefix goes
past the radix match starts a `Prefetch` and stays in the queue; the batches of everything
else go on; once the pages are verified in host memory they hang in the radix tree as a
host-only branch, and the request's admission loads them to the device like any host hit
(overlapped per layer, and never sent early by a prefill node while loading).

One prefetch is two jobs on one worker thread, with the host-page allocation between them
on the scheduler thread (the allocator and the tree are the scheduler's alone):
    LOOKUP (how many leading pages storage holds) -> alloc host pages -> LOAD -> attach.

Invariants:
- the matched node a prefetch hangs its branch under is locked from start to attach, so
  neither tier evicts it (splits keep the node object at the same end position);
- a prefetch belongs to the cache, not to a request: a request that leaves the queue
  meanwhile (abort, timeout) leaves the prefetch to finish and attach, so nothing leaks;
- the host pages it allocated are either attached (counted in `host_total_pages`) or
  freed when it finishes: host free + host pages in the tree == host total once idle;
- requests with the same continuation share one prefetch (keyed by node and first page);
- a request waits for its prefetch at most `timeout_s`, then is computed instead; while a
  prefetch that timed out is still under way the storage counts as stalled and no new
  prefetch starts (each would only wait out the timeout behind it).
"""

from __future__ import annotations

import enum
import logging
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

from pdserve.cache.hiradix_cache import HiNode, HiRadixCache

log = logging.getLogger(__name__)


def _result(future: Future) -> int:
    """A job's page count; 0 if it raised. PageStore counts storage errors itself; anything
    else is a bug that must cost a recompute, not the engine."""
    try:
        return future.result()
    except Exception:
        log.exception("HiCache storage prefetch failed; recomputing")
        return 0


class Stage(enum.Enum):
    LOOKUP = "lookup"
    LOAD = "load"
    DONE = "done"


class Prefetch:
    __slots__ = ("node", "start", "tokens", "keys", "host", "future", "stage", "pages",
                 "t0", "timed_out")

    def __init__(self, node: HiNode, start: int, tokens: list[int], keys: list[str],
                 future: Future) -> None:
        self.node, self.start, self.tokens, self.keys = node, start, tokens, keys
        self.host: list[int] = []
        self.future, self.stage = future, Stage.LOOKUP
        self.pages = 0  # pages attached when DONE
        self.t0 = time.monotonic()
        self.timed_out = False  # a request stopped waiting for it

    @property
    def done(self) -> bool:
        return self.stage is Stage.DONE


class StoragePrefetcher:
    def __init__(self, hi: HiRadixCache, timeout_s: float = 0.0) -> None:
        assert hi.store is not None
        self.hi, self.store, self.timeout_s = hi, hi.store, timeout_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hicache-prefetch")
        self._ops: dict[tuple[int, tuple[int, ...]], Prefetch] = {}

    @property
    def pending(self) -> bool:
        return bool(self._ops)

    def stalled(self) -> bool:
        return any(op.timed_out for op in self._ops.values())

    def ready(self, op: Prefetch) -> bool:
        """The request waiting for `op` may go on: it landed, or the wait timed out."""
        if op.done or op.timed_out:
            return True
        if self.timeout_s and time.monotonic() - op.t0 > self.timeout_s:
            op.timed_out = True
            self.store.count(storage_prefetch_timeouts=1)
            log.warning("HiCache storage: a read took over %gs; computing instead, and not "
                        "reading storage until it ends", self.timeout_s)
            return True
        return False

    def start(self, tokens: list[int]) -> Prefetch | None:
        """Start reading the pages of `tokens` past the radix match that storage may hold;
        None when there is nothing to read (below the load threshold, a branch already in
        the tree, or no host copy to hang it under) or storage is stalled."""
        hi, ps = self.hi, self.hi.page_size
        if self.stalled():
            return None
        m = hi.match(tokens, count=False)
        node = m.host_node
        if node is not hi.root and node.host is None:
            return None  # host copies go top-down (hiradix_cache's invariants)
        start, total = len(m.device_pages) + m.host_pages, len(tokens) // ps
        if total - start < max(1, hi.load_threshold_pages):
            return None
        first = tuple(tokens[start * ps:(start + 1) * ps])
        if first in node.children:
            return None
        ident = (id(node), first)
        if (op := self._ops.get(ident)) is not None:
            return op  # the same continuation is already on its way
        keys = self.store.keys(tokens, total)[start:]
        hi.lock(node)
        op = Prefetch(node, start, tokens[:total * ps], keys,
                      self._pool.submit(self.store.available, keys))
        self._ops[ident] = op
        return op

    def poll(self) -> None:
        """Advance every prefetch whose job finished (scheduler thread, once per step)."""
        for ident, op in list(self._ops.items()):
            if not op.future.done():
                continue
            if op.stage is Stage.LOOKUP:
                self._after_lookup(op)
            else:
                self._attach(op)
            if op.done:
                del self._ops[ident]

    def wait(self, timeout: float) -> None:
        """Wait (GIL released) up to `timeout` s for any prefetch job, then advance."""
        if self._ops:
            futures.wait([op.future for op in self._ops.values()], timeout,
                         return_when=futures.FIRST_COMPLETED)
            self.poll()

    def drain(self) -> None:
        """Finish every prefetch (tests, reset, close)."""
        while self._ops:
            self.wait(1.0)

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)

    def _finish(self, op: Prefetch) -> None:
        op.stage = Stage.DONE
        self.hi.unlock(op.node)

    def _after_lookup(self, op: Prefetch) -> None:
        hi = self.hi
        n = _result(op.future)
        if n < max(1, hi.load_threshold_pages):
            return self._finish(op)
        alloc = hi.host_alloc
        if alloc.num_free < n:
            hi.evict_host(n - alloc.num_free)  # op.node is locked: its path stays
        op.host = alloc.alloc(min(n, alloc.num_free)) or []
        if not op.host:
            return self._finish(op)
        op.stage = Stage.LOAD
        op.future = self._pool.submit(self.store.load, op.keys[:len(op.host)], op.host)

    def _attach(self, op: Prefetch) -> None:
        hi, ps = self.hi, self.hi.page_size
        ok = _result(op.future)
        first = tuple(op.tokens[op.start * ps:(op.start + 1) * ps])
        if ok and first not in op.node.children:  # else computed meanwhile: keep theirs
            new = HiNode(tuple(op.tokens[op.start * ps:(op.start + ok) * ps]), [], op.node)
            new.host = op.host[:ok]
            op.node.children[first] = new
            hi.host_total_pages += ok
            hi.stats["storage_hit_tokens"] += ok * ps
            op.pages = ok
            hi.host_alloc.free(op.host[ok:])
        else:
            hi.host_alloc.free(op.host)
        self._finish(op)
