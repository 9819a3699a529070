"""The prefill node's overlap loop for real (docs/architecture.md, overlap scheduling and
the prefill role), on real prefill engines sending to a real decode engine:

- event order: under the overlap loop the result of extend batch N (first tokens, KV sends)
  is processed after batch N+1 was launched and before N+1's result, for consecutive
  extend batches, and the prefill role never counts a consecutive-prefill sync even when
  configured to sync; under the normal loop the order is the serial one;
- two chunks of one request in flight at once: its pages go out exactly once and in prompt
  order, the decode's KV bytes equal a colocated engine's page for page, and the
  bookkeeping's counters end at 0.
"""

from __future__ import annotations

import pytest
import torch
from pd_pair import BACKENDS, PDCluster, colocated_greedy, greedy, make_engine, random_prompt

MODEL = "tiny-llama"
CHUNK = 16
PROMPTS = [random_prompt(n, seed=3100 + n) for n in (70, 50, 37)]  # 5, 4 and 3 chunks


class PrefillProbe:
    """Records on a prefill engine: launches, result processing (begin and end), KV sends,
    and the most chunks of one request launched and not yet processed."""

    def __init__(self, eng, monkeypatch) -> None:
        self.events: list[tuple] = []
        self.max_inflight: dict[str, int] = {}
        launch, process = eng.executor.launch, eng.out.process

        def on_launch(batch):
            self.events.append(("launch", batch.seq, batch.kind))
            for row in batch.rows:
                rid, n = row.req.rid, row.req.pd.progress.inflight_chunks
                self.max_inflight[rid] = max(self.max_inflight.get(rid, 0), n)
            return launch(batch)

        def on_process(batch, handle):
            self.events.append(("process", batch.seq, batch.kind))
            process(batch, handle)
            self.events.append(("processed", batch.seq, batch.kind))

        monkeypatch.setattr(eng.executor, "launch", on_launch)
        monkeypatch.setattr(eng.out, "process", on_process)

    def watch_sends(self, req) -> None:
        """Log each send of `req` as its logical page indices (prompt order)."""
        send = req.pd.sender.send

        def on_send(pages, last=False, metadata=None):
            self.events.append(("send", req.rid, [req.pages.index(p) for p in pages], last))
            send(pages, last=last, metadata=metadata)

        req.pd.sender.send = on_send

    def index(self, kind: str, seq: int) -> int:
        return next(i for i, e in enumerate(self.events) if e[:2] == (kind, seq))

    def extend_seqs(self) -> list[int]:
        return [e[1] for e in self.events if e[0] == "launch" and e[2] == "extend"]

    def sends(self, rid: str) -> list[tuple[list[int], bool]]:
        return [(e[2], e[3]) for e in self.events if e[0] == "send" and e[1] == rid]


@pytest.fixture(scope="module")
def pd():
    cluster = PDCluster(
        MODEL, "mooncake",
        prefills=[{"chunked_prefill_size": CHUNK, "consecutive_prefill": "sync"},
                  {"chunked_prefill_size": CHUNK, "disable_overlap": True}],
        decodes=[{}])
    yield cluster
    cluster.close()


def run_probed(pd, p: int, monkeypatch) -> tuple[PrefillProbe, list]:
    probe = PrefillProbe(pd.prefills[p], monkeypatch)
    pd.reset_caches()
    legs = [pd.submit(x, greedy(8), p=p) for x in PROMPTS]
    for leg in legs:
        probe.watch_sends(leg.prefill)
    pd.run(timeout=60)
    assert [leg.output_ids for leg in legs] == colocated_greedy(MODEL, PROMPTS, 8)
    pd.assert_pools_full()
    return probe, legs


def test_overlap_prefill_processes_n_while_n_plus_1_runs(pd, monkeypatch):
    eng = pd.prefills[0]
    assert eng.cfg.consecutive_prefill == "sync"  # configured, and ignored by the role
    probe, legs = run_probed(pd, 0, monkeypatch)
    seqs = probe.extend_seqs()
    assert len(seqs) >= 5
    pairs = [(a, b) for a, b in zip(seqs, seqs[1:], strict=False) if b == a + 1]
    assert len(pairs) >= 4  # back-to-back extend batches
    for n, n1 in pairs:
        assert probe.index("launch", n1) < probe.index("process", n) < \
            probe.index("processed", n) < probe.index("process", n1), (n, probe.events)
    # Every send happens inside some batch's result processing (none while scheduling).
    depth = 0
    for e in probe.events:
        depth += {"process": 1, "processed": -1}.get(e[0], 0)
        assert e[0] != "send" or depth == 1, probe.events
    assert "consecutive_prefill" not in eng.loop.stats.overlap_disabled
    assert eng.loop.max_depth == 2


def test_normal_prefill_is_serial(pd, monkeypatch):
    probe, _ = run_probed(pd, 1, monkeypatch)
    seqs = probe.extend_seqs()
    assert len(seqs) >= 5
    for n, n1 in zip(seqs, seqs[1:], strict=False):
        assert probe.index("launch", n) < probe.index("process", n) < \
            probe.index("processed", n) < probe.index("launch", n1)


def test_two_chunks_in_flight_send_every_page_once_in_order(pd, monkeypatch):
    probe, legs = run_probed(pd, 0, monkeypatch)
    for leg in legs:
        req, n = leg.prefill, len(leg.prefill.prompt_ids)
        assert probe.max_inflight[leg.rid] == 2  # chunk k+1 launched before k's result
        sends = probe.sends(leg.rid)
        assert [p for pages, _ in sends for p in pages] == list(range(-(-n // 16)))
        assert [last for _, last in sends] == [False] * (len(sends) - 1) + [True]
        assert req.pd.progress.inflight_middle_chunks == 0 and req.pd.progress.inflight_chunks == 0
        assert req.pd.progress.sent_pages == req.pd.progress.total_pages


# -- KV bytes: PD (overlap prefill, two chunks in flight) == colocated, page for page -------


def kv_at_finish(eng, monkeypatch, store: dict) -> None:
    """On `eng`, copy each request's prompt KV (every layer, K and V) when it finishes."""
    finish = eng.out.finish

    def on_finish(req, reason, cache_it=True):
        if req.slot is not None and req.rid not in store:
            slots = eng.kv_pool.slots_of(req.pages, 0, len(req.prompt_ids))
            pool = eng.kv_pool
            store[req.rid] = torch.stack([b[slots] for b in pool.k_buffers + pool.v_buffers])
        finish(req, reason, cache_it)

    monkeypatch.setattr(eng.out, "finish", on_finish)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_kv_equals_colocated_page_for_page(backend, monkeypatch):
    prompt = random_prompt(150, seed=3200)  # 10 chunks, partial last page
    cluster = PDCluster(MODEL, backend, prefills=[{"chunked_prefill_size": CHUNK}])
    colo = make_engine(MODEL, None, chunked_prefill_size=CHUNK)
    try:
        got, want = {}, {}
        kv_at_finish(cluster.decodes[0], monkeypatch, got)
        kv_at_finish(colo, monkeypatch, want)
        probe = PrefillProbe(cluster.prefills[0], monkeypatch)
        leg = cluster.submit(prompt, greedy(4))
        cluster.run(timeout=60)
        assert probe.max_inflight[leg.rid] == 2
        colo.add_request("ref", list(prompt), greedy(4))
        colo.run_until_idle()
        a, b = got[leg.rid], want["ref"]
        assert a.shape == b.shape == (2 * len(colo.kv_pool.k_buffers), 150, *a.shape[2:])
        for page in range(-(-150 // 16)):
            sl = slice(16 * page, 16 * page + 16)
            assert torch.equal(a[:, sl], b[:, sl]), f"page {page} differs"
        assert [leg.output_ids] == colocated_greedy(MODEL, [prompt], 4)
        cluster.assert_pools_full()
        assert colo.pools_full()
    finally:
        cluster.close()
        colo.close()
