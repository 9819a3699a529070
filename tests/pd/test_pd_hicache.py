"""The prefill's early send never ships a page whose HiCache load is pending
(docs/architecture.md: HiCache, PD bookkeeping).

Set-up on a real prefill -> decode pair (tcp transfers between the engines' threads): a
10-page document is cached on the prefill, forced out to the host tier, and its first 4
pages loaded back by another request, so the next request finds 4 pages on the device and
6 on the host only (or, in the storage case, only in a file storage tier, read into the
host tier at admission). Freed device pages are poisoned, the prefill's host->device copies are
held by the controller's gate, and the request goes through the pair:
- while the gate is closed, the early send carries exactly the 4 device-resident pages and
  the decode's pages for the loading range are still untouched;
- after it opens, every page went to the sender once, in order, and the decode's KV equals
  a colocated engine's KV page for page; the output equals the colocated output.
The negative control forces `loading_pages` empty: the decode then holds poisoned KV,
which proves the first test can catch the bug.
"""

from __future__ import annotations

import time

import pytest
import torch
from pd_pair import PDCluster, colocated, colocated_greedy, greedy, random_prompt

from kv_transfer import KVSender

MODEL, PS, POISON = "tiny-llama", 16, 1000.0
DOC = random_prompt(160, seed=4242)
WARM = DOC[:64] + random_prompt(20, seed=4243)
PROMPT = DOC + random_prompt(9, seed=4244)


@pytest.fixture(params=["host", "storage"])
def pair(request, monkeypatch, tmp_path):
    """host: the document's tail is on the host tier; storage: only in a file storage tier
    (both memory tiers emptied), read into the host tier at admission."""
    sent: list[tuple[int, list[int]]] = []
    real = KVSender.send

    def record(self, page_indices, last=False, metadata=None):
        sent.append((self.room, [int(p) for p in page_indices]))
        return real(self, page_indices, last, metadata)

    monkeypatch.setattr(KVSender, "send", record)
    extra = {"hicache_storage_backend": "file", "hicache_storage_path": str(tmp_path)} \
        if request.param == "storage" else {}
    c = PDCluster(MODEL, "tcp", prefills=[{"enable_hierarchical_cache": True,
                                           "max_total_tokens": 1024, **extra}])
    c.sent = sent
    c.tier = request.param
    yield c
    c.close()


def _page_view(engine, buf):
    return buf.view(engine.kv_pool.num_pages, PS, *buf.shape[1:])


def _pages_kv(engine, pages: list[int]) -> list[torch.Tensor]:
    return [_page_view(engine, b)[pages].clone()
            for b in engine.kv_pool.k_buffers + engine.kv_pool.v_buffers]


def _prepare(c: PDCluster) -> None:
    p = c.prefills[0]
    c.generate([DOC + [7]], greedy(2))
    assert p.pools_full()
    p.kv.drain_copies()
    p.kv.cache.evict(p.kv.cache.total_pages)  # the document now lives on the host only
    if c.tier == "storage":  # ... or only in storage
        p.kv.cache.evict_host(p.kv.cache.host_total_pages)
    c.generate([WARM], greedy(2))  # loads its first 4 pages back
    c.reset_caches("d")
    assert p.pools_full()
    m = p.kv.cache.match(PROMPT, count=False)
    host = 0 if c.tier == "storage" else 6  # storage: read at admission
    assert len(m.device_pages) == 4 and m.host_pages == host, m[:1] + m[2:3]
    free = list(p.kv_pool.allocator._free)
    for b in p.kv_pool.k_buffers + p.kv_pool.v_buffers:
        _page_view(p, b)[free] = POISON
    d = c.decodes[0]  # zero the decode's free pages: what arrives there becomes visible
    free = list(d.kv_pool.allocator._free)
    for b in d.kv_pool.k_buffers + d.kv_pool.v_buffers:
        _page_view(d, b)[free] = 0.0


def _start_gated(c: PDCluster):
    """Submit PROMPT with the prefill's loads held; return the legs once the prefill has
    admitted it (load pending) and the early-sent pages reached the decode."""
    p = c.prefills[0]
    p.hicache.gate.clear()
    leg = c.submit(PROMPT, greedy(6))
    c.run(timeout=60, until=lambda: leg.prefill.load_op != 0)
    assert p.hicache.is_loading()
    return leg, list(leg.prefill.pages), list(leg.decode.pages)


def _wait_decode(c: PDCluster, cond, what: str) -> None:
    deadline = time.monotonic() + 60
    while not cond():
        assert time.monotonic() < deadline, what
        c.decodes[0].poll_role()
        c.prefills[0].role.poll()  # the deferred send must hold back while loads pend
        time.sleep(0.01)


def test_early_send_excludes_loading_pages(pair):
    c = pair
    p, d = c.prefills[0], c.decodes[0]
    _prepare(c)
    leg, p_pages, d_pages = _start_gated(c)
    assert leg.prefill.load_pages == range(4, 10)
    if c.tier == "storage":
        # 4 pages for WARM, then the 6 of the loading range
        assert p.hicache_stats()["storage"]["storage_hit_pages"] == 4 + 6

    def early_arrived():
        return all(bool(t.abs().sum()) for t in _pages_kv(d, d_pages[:4]))

    _wait_decode(c, early_arrived, "the early-sent device pages never reached the decode")
    room_sends = [pages for room, pages in c.sent if room == leg.room]
    assert room_sends == [p_pages[:4]], "the early send did not carry exactly pages 0..3"
    assert all(not t.abs().sum() for t in _pages_kv(d, d_pages[4:10])), \
        "pages of the loading range reached the decode while the gate was closed"
    p.hicache.gate.set()
    c.run(timeout=60)
    flat = [x for room, pages in c.sent if room == leg.room for x in pages]
    assert flat == p_pages, "pages not sent exactly once, in order"
    ref_llm = colocated(MODEL)
    assert leg.output_ids == colocated_greedy(MODEL, [PROMPT], 6)[0]
    ref_pages = ref_llm.engine.kv.cache.match_prefix(PROMPT, count=False)[0]
    assert len(ref_pages) == 10
    got, want = _pages_kv(d, d_pages[:10]), _pages_kv(ref_llm.engine, ref_pages)
    for g, w in zip(got, want, strict=True):
        assert g.abs().max() < POISON / 2
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    c.assert_pools_full()


def test_negative_control_without_exclusion_ships_poison(pair, monkeypatch):
    c = pair
    p, d = c.prefills[0], c.decodes[0]
    monkeypatch.setattr(p.role, "loading_pages", lambda req: frozenset())
    _prepare(c)
    leg, p_pages, d_pages = _start_gated(c)

    def poisoned():
        return any(bool((t >= POISON / 2).any()) for t in _pages_kv(d, d_pages[4:10]))

    _wait_decode(c, poisoned, "without the exclusion the decode should see poisoned KV")
    p.hicache.gate.set()
    c.run(timeout=60)
    c.assert_pools_full()


def test_guard_refuses_loading_pages():
    from types import SimpleNamespace

    from prefill_node.role import PrefillRole

    role = PrefillRole.__new__(PrefillRole)  # the guard needs no engine or transfer manager
    role.loading_pages = lambda req: frozenset({4, 5})
    req = SimpleNamespace(rid="r")
    role._guard(req, range(0, 4))
    role._guard(req, range(6, 9))
    with pytest.raises(RuntimeError, match="HiCache load is pending"):
        role._guard(req, range(3, 5))


def test_deferred_pages_go_once_in_order():
    from prefill_node.bookkeeping import SendProgress

    sp = SendProgress(prompt_len=10 * PS + 3, page_size=PS)
    assert sp.early_send(10 * PS, frozenset(range(4, 10))) == range(0, 4)
    assert sp.early_send(10 * PS, frozenset(range(4, 10))) == range(4, 4)
    assert sp.early_send(10 * PS) == range(4, 10)  # the load is done
    sp.chunk_scheduled(10 * PS + 3)
    assert sp.chunk_done(False).pages == range(10, 11)


def test_decode_prefix_host_hit_loads_before_commit():
    """HiCache on the decode node: its cached prefix was forced to the host; the request
    loads it back (not transferred), commits only once loaded, and decodes exactly."""
    c = PDCluster(MODEL, "tcp", decodes=[{"enable_hierarchical_cache": True}])
    try:
        d = c.decodes[0]
        c.generate([DOC + [7]], greedy(2))
        assert d.pools_full()
        d.kv.cache.evict(d.kv.cache.total_pages)
        free = list(d.kv_pool.allocator._free)
        for b in d.kv_pool.k_buffers + d.kv_pool.v_buffers:
            _page_view(d, b)[free] = POISON
        hits = d.memory_stats()["host_hit_tokens"]
        leg = c.generate([PROMPT], greedy(6))[0]
        assert d.memory_stats()["host_hit_tokens"] - hits == 10 * PS
        assert leg.output_ids == colocated_greedy(MODEL, [PROMPT], 6)[0]
        c.assert_pools_full()
    finally:
        c.close()
