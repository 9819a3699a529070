"""KV memory manager: request slots, KV pages and the prefix cache as one resource.

Every method keeps one accounting identity that tests read through `stats()`:
    free pages + pages held by the cache + pages held by requests (outside the cache)
    == total pages.
When no request is alive, `idle_is_full()` says free + evictable == total and all
request slots are free. With HiCache (`ctrl` given) the cache is a `HiRadixCache` and the
host tier keeps its own identity: host free + host pages in the tree == host total
(docs/architecture.md: HiCache).
"""

from __future__ import annotations

from pdserve.cache.hicache_controller import HiCacheController
from pdserve.cache.hiradix_cache import HiNode, HiRadixCache
from pdserve.cache.kv_storage import PageStore
from pdserve.cache.radix_cache import Node, RadixCache
from pdserve.cache.storage_prefetch import StoragePrefetcher
from pdserve.engine.request import Req
from pdserve.memory.host_pool import HostKVPool
from pdserve.memory.kv_pool import KVPool
from pdserve.memory.req_to_token import ReqToTokenPool


class KVManager:
    def __init__(self, kv_pool: KVPool, req_pool: ReqToTokenPool, use_cache: bool,
                 host_pool: HostKVPool | None = None, ctrl: HiCacheController | None = None,
                 write_policy: str = "write_through", store: PageStore | None = None,
                 prefetch_timeout_s: float = 0.0) -> None:
        self.kv = kv_pool
        self.req_pool = req_pool
        self.page_size = kv_pool.page_size
        self.alloc = kv_pool.allocator
        self.host_pool, self.ctrl = host_pool, ctrl
        self.cache: RadixCache | HiRadixCache | None = None
        if use_cache and ctrl is not None and host_pool is not None:
            self.cache = HiRadixCache(self.page_size, self.alloc.free, host_pool.allocator,
                                      ctrl, write_policy, store=store)
        elif use_cache:
            self.cache = RadixCache(self.page_size, self.alloc.free)
        self.hi = self.cache if isinstance(self.cache, HiRadixCache) else None
        # Reads from the storage tier for waiting requests (None: no storage tier).
        self.prefetcher = (StoragePrefetcher(self.hi, prefetch_timeout_s)
                           if self.hi and store else None)

    # -- capacity -------------------------------------------------------------
    @property
    def available_pages(self) -> int:
        """Pages obtainable now: free plus evictable from the cache."""
        return self.alloc.num_free + (self.cache.evictable_pages if self.cache else 0)

    def pages_for(self, req: Req, new_len: int) -> int:
        """Pages `req` must still allocate to hold `new_len` positions."""
        need = -(-new_len // self.page_size)
        return max(0, need - len(req.pages))

    def _alloc_pages(self, n: int) -> list[int] | None:
        if n == 0:
            return []
        if self.alloc.num_free < n and self.cache is not None:
            self.cache.evict(n - self.alloc.num_free)
        return self.alloc.alloc(n)

    # -- request life -----------------------------------------------------------
    def admit(self, req: Req) -> bool:
        """Give `req` a request slot and its cached prefix. False if no slot is free."""
        slot = self.req_pool.alloc()
        if slot is None:
            return False
        req.slot = slot
        req.pages, req.cached_len, req.kv_len = [], 0, 0
        if self.cache is not None:
            # Keep at least one token to compute: its logits give the next token.
            # Prompt logprobs need every prompt position's logits: reuse nothing then.
            prefix = self._reusable(req)
            node: Node  # a HiNode under HiCache; lock/unlock take either
            if self.hi is not None:
                pages, node = self._match_and_load(self.hi, req, prefix)
            else:
                pages, node = self.cache.match_prefix(prefix)
            self.cache.lock(node)
            req.cache_node, req.pages = node, list(pages)
            req.cached_len = req.kv_len = len(pages) * self.page_size
            if req.retractions == 0:
                req.cached_tokens = req.cached_len
            self.req_pool.write(slot, 0, self.kv.slots_of(req.pages, 0, req.kv_len))
        return True

    @staticmethod
    def _reusable(req: Req) -> list[int]:
        """The prompt positions whose KV may come from a cache. At least one token is
        computed (its logits give the next token); prompt logprobs need every position's
        logits, so nothing is reused then."""
        return [] if req.wants_prompt_logprobs() else req.fill_ids[:len(req.fill_ids) - 1]

    def prefetched(self, req: Req) -> bool:
        """False while a storage read for `req`'s prefix is under way: it stays queued
        (pdserve/cache/storage_prefetch.py). The first call starts the read."""
        if self.prefetcher is None:
            return True
        if req.prefetch is None:
            req.prefetch = self.prefetcher.start(self._reusable(req)) or True
        return req.prefetch is True or self.prefetcher.ready(req.prefetch)

    def preallocate(self, req: Req, new_len: int) -> bool:
        """`admit` plus pages for positions up to `new_len`, all or nothing: the decode
        role's pre-allocation, whose pages another node fills. False: nothing held."""
        if not self.admit(req):
            return False
        if self.extend(req, new_len) is None:
            self.release(req, cache_it=False)
            return False
        return True

    def _match_and_load(self, hi: HiRadixCache, req: Req, prefix: list[int]
                        ) -> tuple[list[int], HiNode]:
        """HiCache admission (`hi`: `self.hi`, known present): device hit plus, when worth it
        and the device has room, the host-only part loaded back (asynchronously; the batch
        waits per layer)."""
        m = hi.match(prefix)
        pages, node = list(m.device_pages), m.device_node
        if m.load_op:  # part of the device hit is still being loaded (for another request)
            req.load_op, req.load_pages = m.load_op, m.loading
        loaded = hi.load_back(m, self._alloc_pages) if m.host_pages else None
        if loaded is not None:
            new, op = loaded
            start = req.load_pages.start if req.load_op else len(pages)
            req.load_op, req.load_pages = op, range(start, len(pages) + len(new))
            pages.extend(new)
            node = m.host_node
        return pages, node

    def check_acks(self) -> None:
        """Acknowledge finished HiCache copies (unlocks their nodes) and advance storage
        prefetches; once per step."""
        if self.hi is not None:
            self.hi.check_acks()
        if self.prefetcher is not None:
            self.prefetcher.poll()

    def wait_for_copy(self, timeout: float) -> bool:
        """Nothing can run until a HiCache copy unlocks its pages or a storage prefetch
        lands: wait (GIL released) up to `timeout` s for one. False, at once, when none is
        pending."""
        if self.prefetcher is not None and self.prefetcher.pending:
            self.prefetcher.wait(timeout)
            return True
        if self.hi is None or not self.hi.has_pending:
            return False
        self.hi.wait_oldest(timeout)
        return True

    def load_barrier(self) -> int:
        """The newest HiCache load a batch launched now must wait for, per layer (0: none)."""
        if self.ctrl is None or not self.ctrl.is_loading():
            return 0
        return self.ctrl.last_load

    def loading_pages(self, req: Req) -> frozenset[int]:
        """Indices into `req.pages` whose HiCache load has not completed."""
        if self.ctrl is None or not req.load_op or self.ctrl.done(req.load_op):
            return frozenset()
        return frozenset(req.load_pages)

    def wait_loaded(self, req: Req) -> None:
        """Block until `req`'s HiCache load is published as done. Called once a forward read
        every layer of it (so the copy is complete; the copy thread may lag a little)."""
        if self.ctrl is not None and req.load_op:
            self.ctrl.wait(req.load_op)

    def extend(self, req: Req, new_len: int) -> list[int] | None:
        """Allocate KV for positions [kv_len, new_len); return their slots (None: no room)."""
        pages = self._alloc_pages(self.pages_for(req, new_len))
        if pages is None:
            return None
        assert req.slot is not None, "extend needs an admitted request"
        req.pages.extend(pages)
        slots = self.kv.slots_of(req.pages, req.kv_len, new_len)
        self.req_pool.write(req.slot, req.kv_len, slots)
        req.kv_len = new_len
        return slots

    def cache_prompt(self, req: Req) -> bool:
        """Put the whole pages of `req`'s computed prompt into the cache now, while it keeps
        running, so requests admitted after it reuse them (the n choices of one OpenAI
        request: docs/architecture.md: Logprobs). The request keeps them locked and they
        count as its cached prefix from now on. Done only when the tree holds exactly the
        prefix the request locked (no duplicate pages to sort out); False otherwise."""
        if self.cache is None or req.slot is None or req.kv_len < len(req.prompt_ids):
            return False
        full = len(req.prompt_ids) // self.page_size
        own = req.cached_len // self.page_size
        if full <= own:
            return False
        tokens = req.prompt_ids[: full * self.page_size]
        pages, _ = self.cache.match_prefix(tokens, count=False)
        if len(pages) != own:
            return False
        if self.hi is not None:
            # No device duplicates: the tree held exactly the `own` pages this request
            # locked (checked above); a host-only node past them takes our pages back.
            dups = self.hi.insert_dups(tokens, req.pages[:full])
            assert all(i < own for i in dups), dups
        else:
            self.cache.insert(tokens, req.pages[:full])
        _, node = self.cache.match_prefix(tokens, count=False)
        self.cache.lock(node)
        assert req.cache_node is not None  # admit locked one: this cache is on
        self.cache.unlock(req.cache_node)
        req.cache_node, req.cached_len = node, full * self.page_size
        return True

    def release(self, req: Req, cache_it: bool = True) -> None:
        """Return the request's slot and pages. Whole computed pages go into the cache."""
        if req.slot is None:
            return
        computed = min(req.kv_len, len(req.prompt_ids) + len(req.output_ids) - 1)
        if self.cache is not None:
            full = computed // self.page_size if cache_it else req.cached_len // self.page_size
            tokens = (req.prompt_ids + req.output_ids)[: full * self.page_size]
            own_start = req.cached_len // self.page_size
            if self.hi is not None:
                dups = self.hi.insert_dups(tokens, req.pages[:full])
                self.alloc.free([req.pages[i] for i in dups if i >= own_start])
            else:
                present = self.cache.insert(tokens, req.pages[:full])
                # Pages [cached, present) are duplicates of what others cached meanwhile.
                self.alloc.free(req.pages[own_start:present])
            self.alloc.free(req.pages[full:])
            assert req.cache_node is not None  # admit locked one: this cache is on
            self.cache.unlock(req.cache_node)
        else:
            self.alloc.free(req.pages)
        self.req_pool.free(req.slot)
        req.slot, req.pages, req.cache_node = None, [], None
        req.load_op, req.load_pages = 0, range(0)
        req.cached_len = req.kv_len = 0

    # -- accounting ---------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        cached = self.cache.total_pages if self.cache else 0
        return {
            "total_pages": self.alloc.num_pages,
            "free_pages": self.alloc.num_free,
            "cached_pages": cached,
            "evictable_pages": self.cache.evictable_pages if self.cache else 0,
            "total_slots": self.req_pool.size,
            "free_slots": self.req_pool.num_free,
            **self._host_stats(),
        }

    def _host_stats(self) -> dict[str, int]:
        if self.host_pool is None:
            return {}
        out = {"host_total_pages": self.host_pool.num_pages,
               "host_free_pages": self.host_pool.allocator.num_free,
               "host_cached_pages": self.hi.host_total_pages if self.hi else 0}
        if self.hi is not None:
            out.update(self.hi.stats)
        if self.ctrl is not None:
            # int(): the ops and bytes entries are counts; the dict's floats are *_seconds.
            out.update({k: int(v) for k, v in self.ctrl.stats.items()
                        if k.endswith(("ops", "bytes"))})
        return out

    def drain_copies(self) -> None:
        """Wait for every storage prefetch and submitted HiCache copy, and acknowledge them
        (idle engine only)."""
        if self.prefetcher is not None:
            self.prefetcher.drain()
        if self.hi is not None:
            self.hi.ctrl.wait(self.hi.ctrl.last_op)  # the same controller as self.ctrl
            self.hi.check_acks()

    def idle_is_full(self) -> bool:
        s = self.stats()
        return (s["free_pages"] + s["evictable_pages"] == s["total_pages"]
                and s["free_slots"] == s["total_slots"]
                and (self.cache is None or self.cache.locked_pages == 0)
                and (self.hi is None or not self.hi.has_pending)
                and (self.prefetcher is None or not self.prefetcher.pending))

    def flush(self) -> None:
        """Drop every unlocked prefix from the cache (a storage read under way keeps the
        node it attaches to locked, and attaches later)."""
        if self.cache is not None:
            self.cache.reset()

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
