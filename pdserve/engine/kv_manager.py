"""KV memory manager: request slots, KV pages and the prefix cache as one resource.

Every method keeps one accounting identity that tests read through `stats()`:
    free pages + pages held by the cache + pages held by requests (outside the cache)
    == total pages.
When no request is alive, `idle_is_full()` says free + evictable == total and all
request slots are free.
"""

from __future__ import annotations

from pdserve.cache.radix_cache import RadixCache
from pdserve.engine.request import Req
from pdserve.memory.kv_pool import KVPool
from pdserve.memory.req_to_token import ReqToTokenPool


class KVManager:
    def __init__(self, kv_pool: KVPool, req_pool: ReqToTokenPool, use_cache: bool) -> None:
        self.kv = kv_pool
        self.req_pool = req_pool
        self.page_size = kv_pool.page_size
        self.alloc = kv_pool.allocator
        self.cache = RadixCache(self.page_size, self.alloc.free) if use_cache else None

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
            usable = 0 if req.wants_prompt_logprobs() else len(req.fill_ids) - 1
            pages, node = self.cache.match_prefix(req.fill_ids[:usable])
            self.cache.lock(node)
            req.cache_node, req.pages = node, list(pages)
            req.cached_len = req.kv_len = len(pages) * self.page_size
            if req.retractions == 0:
                req.cached_tokens = req.cached_len
            self.req_pool.write(slot, 0, self.kv.slots_of(req.pages, 0, req.kv_len))
        return True

    def extend(self, req: Req, new_len: int) -> list[int] | None:
        """Allocate KV for positions [kv_len, new_len); return their slots (None: no room)."""
        pages = self._alloc_pages(self.pages_for(req, new_len))
        if pages is None:
            return None
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
        self.cache.insert(tokens, req.pages[:full])
        _, node = self.cache.match_prefix(tokens, count=False)
        self.cache.lock(node)
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
            present = self.cache.insert(tokens, req.pages[:full])
            # Pages [cached, present) are duplicates of what others cached meanwhile.
            own_start = req.cached_len // self.page_size
            self.alloc.free(req.pages[own_start:present])
            self.alloc.free(req.pages[full:])
            self.cache.unlock(req.cache_node)
        else:
            self.alloc.free(req.pages)
        self.req_pool.free(req.slot)
        req.slot, req.pages, req.cache_node = None, [], None
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
        }

    def idle_is_full(self) -> bool:
        s = self.stats()
        return (s["free_pages"] + s["evictable_pages"] == s["total_pages"]
                and s["free_slots"] == s["total_slots"]
                and (self.cache is None or self.cache.locked_pages == 0))
