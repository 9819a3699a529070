"""Token-exact PD: the decode leg's greedy output equals the colocated engine's (and
transformers `generate`) across {overlap, normal} x {chunked 64, unchunked} x {page 1, 16}
x {prefix cache cold, warm} on both transfer backends (docs/architecture.md: Request lifecycles, PD
bookkeeping, KV transfer).

Each case runs three passes over the same prompts (lengths around the page size, the chunk
size and a partial last page, plus a set sharing a 37-token prefix):
  cold        both prefix caches empty;
  warm        both caches hold every prompt (prefill sends cached pages early, the decode
              asks only for pages past its own cached prefix);
  warm-P      the prefill cache is warm but the decode's was dropped: the early-sent pages
              really travel.
Engines are built once per (model, backend, page size, loop): one decode engine and two
prefill engines (chunked 64 / unchunked), reused by the chunk cases.
"""

from __future__ import annotations

import pytest
from hf_reference import hf_greedy
from pd_pair import (
    BACKENDS,
    SMOLLM,
    TINY_MODELS,
    PDCluster,
    colocated_greedy,
    greedy,
    random_prompt,
)

NEW_TOKENS = 16
PROMPT_LENS = (1, 9, 16, 17, 40, 64, 65, 100, 150)
PROMPTS = [random_prompt(n, seed=500 + i) for i, n in enumerate(PROMPT_LENS)]
_BASE = PROMPTS[PROMPT_LENS.index(150)]
SHARED = [_BASE[:37] + random_prompt(k, seed=900 + k) for k in (3, 27, 90)]  # 40, 64, 127
ALL = PROMPTS + SHARED
HF_CHECKED = (3, 6, 8)  # prompts of 17, 65 and 150 tokens also checked against transformers

CHUNKS = {"chunk64": 64, "unchunked": 0}


def _cases():
    # Ordered so that consecutive cases share one cluster (see `cluster_for`).
    for model in TINY_MODELS:
        for backend in BACKENDS:
            for page in (1, 16):
                for loop in ("overlap", "normal"):
                    for chunk in CHUNKS:
                        yield pytest.param(model, backend, page, loop, chunk,
                                           id=f"{model}-{backend}-page{page}-{loop}-{chunk}")


_current: dict = {}


def cluster_for(model: str, backend: str, page: int, loop: str) -> PDCluster:
    key = (model, backend, page, loop)
    if _current.get("key") != key:
        drop_cluster()
        common = {"page_size": page, "disable_overlap": loop == "normal"}
        _current["cluster"] = PDCluster(
            model, backend,
            prefills=[{**common, "chunked_prefill_size": CHUNKS[c]} for c in CHUNKS],
            decodes=[common])
        _current["key"] = key
    return _current["cluster"]


def drop_cluster() -> None:
    cluster = _current.pop("cluster", None)
    _current.pop("key", None)
    if cluster is not None:
        cluster.close()


@pytest.fixture(scope="module", autouse=True)
def _close_last_cluster():
    yield
    drop_cluster()


def run_pass(cluster: PDCluster, p: int, model: str, name: str, n: int = NEW_TOKENS,
             prompts=ALL):
    legs = cluster.generate(prompts, greedy(n), p=p)
    want = colocated_greedy(model, prompts, n)
    bad = [(len(x), leg.output_ids, w) for x, leg, w in zip(prompts, legs, want, strict=True)
           if leg.output_ids != w]
    assert not bad, f"{name} pass: PD output != colocated (prompt len, PD, colocated): {bad}"
    cluster.assert_pools_full()
    return legs


def check_three_passes(cluster: PDCluster, p: int, model: str, page: int, n: int = NEW_TOKENS,
                       prompts=ALL) -> list:
    prefill, decode = cluster.prefills[p], cluster.decodes[0]
    cluster.reset_caches()
    cold = run_pass(cluster, p, model, "cold", n, prompts)

    early0 = prefill.role.early_sent_pages
    warm = run_pass(cluster, p, model, "warm", n, prompts)
    long_enough = [i for i, x in enumerate(prompts) if len(x) > page]
    assert all(warm[i].prefill.cached_tokens > 0 for i in long_enough), \
        [(len(prompts[i]), warm[i].prefill.cached_tokens) for i in long_enough]
    assert all(warm[i].decode.cached_tokens > 0 for i in long_enough), \
        [(len(prompts[i]), warm[i].decode.cached_tokens) for i in long_enough]
    assert prefill.role.early_sent_pages > early0, "warm prefill cache: no page sent early"

    cluster.reset_caches("d")
    early1 = prefill.role.early_sent_pages
    received = decode.role.mgr.metrics()["bytes_received"]
    warm_p = run_pass(cluster, p, model, "warm-prefill/cold-decode", n, prompts)
    assert all(leg.decode.cached_tokens == 0 for leg in warm_p[:1])
    assert prefill.role.early_sent_pages > early1
    assert decode.role.mgr.metrics()["bytes_received"] > received
    return cold


@pytest.mark.parametrize(("model", "backend", "page", "loop", "chunk"), list(_cases()))
def test_pd_token_exact(model, backend, page, loop, chunk):
    ok = False
    cluster = cluster_for(model, backend, page, loop)
    try:
        p = list(CHUNKS).index(chunk)
        cold = check_three_passes(cluster, p, model, page)
        if page == 16 and loop == "overlap" and chunk == "chunk64":
            for i in HF_CHECKED:
                assert cold[i].output_ids == list(hf_greedy(model, tuple(ALL[i]), NEW_TOKENS)), \
                    f"PD != transformers for a prompt of {len(ALL[i])} tokens"
        ok = True
    finally:
        if not ok:
            drop_cluster()  # do not hand a broken cluster to the next case


# -- smollm2-135m (float32): a subset, it is 135M parameters on CPU ----------------------------

SMOLLM_TOKENS = 8
SMOLLM_PROMPTS = [random_prompt(n, seed=700 + n) for n in (9, 17, 65, 130)]
SMOLLM_PROMPTS.append(SMOLLM_PROMPTS[-1][:37] + random_prompt(40, seed=777))


@pytest.mark.parametrize("backend", BACKENDS)
def test_pd_token_exact_smollm2(backend):
    drop_cluster()
    cluster = PDCluster(SMOLLM, backend,
                        prefills=[{"page_size": 16, "chunked_prefill_size": 64}],
                        decodes=[{"page_size": 16}])
    try:
        cold = check_three_passes(cluster, 0, SMOLLM, 16, SMOLLM_TOKENS, SMOLLM_PROMPTS)
        for i in (1, 3):
            want = hf_greedy(SMOLLM, tuple(SMOLLM_PROMPTS[i]), SMOLLM_TOKENS)
            assert cold[i].output_ids == list(want), len(SMOLLM_PROMPTS[i])
    finally:
        cluster.close()


# -- HiCache axis: prefixes loaded back from the host tier --------------------------------


def _to_host(engine) -> None:
    """Evict every cached prefix from the device (write-through: the host copies stay) and
    poison the freed device pages, so KV that was not really loaded back cannot pass."""
    assert engine.pools_full()  # also waits for pending backups
    engine.kv.cache.evict(engine.kv.cache.total_pages)
    pool = engine.kv_pool
    free = list(pool.allocator._free)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.view(pool.num_pages, engine.cfg.page_size, *buf.shape[1:])[free] = 1000.0


@pytest.mark.parametrize("loop", ["overlap", "normal"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_pd_token_exact_hicache(backend, loop):
    """With HiCache on both sides: cold pass, then every cached prefix is forced out to the
    host tier on both nodes (device copies poisoned) and the same prompts run again; both
    passes equal the colocated engine token for token, the second hits the host tier on
    the prefill and the decode side, and both tiers are full afterwards."""
    model = TINY_MODELS[0]
    common = {"page_size": 16, "disable_overlap": loop == "normal",
              "enable_hierarchical_cache": True}
    cluster = PDCluster(model, backend, prefills=[{**common, "chunked_prefill_size": 64}],
                        decodes=[common])
    try:
        run_pass(cluster, 0, model, "cold")
        for e in cluster.engines:
            _to_host(e)
        hits = [e.kv.cache.stats["host_hit_tokens"] for e in cluster.engines]
        run_pass(cluster, 0, model, "loaded back from the host tier")
        after = [e.kv.cache.stats["host_hit_tokens"] for e in cluster.engines]
        assert all(a > h for a, h in zip(after, hits, strict=True)), (hits, after)
        for e in cluster.engines:
            assert e.pools_full()
            e.kv.cache.reset()
            s = e.memory_stats()
            assert s["free_pages"] == s["total_pages"], s
            assert s["host_free_pages"] == s["host_total_pages"], s
    finally:
        cluster.close()


def test_pd_token_exact_triton_attention():
    """Both nodes on `--attention-backend triton` (Triton's interpreter on this CPU): the
    decode leg equals the colocated default engine token for token, cold and warm (the
    prefill then serves prompts from its prefix cache: extend rows starting mid-context)."""
    model = TINY_MODELS[0]
    prompts = [PROMPTS[PROMPT_LENS.index(n)] for n in (9, 65)] + SHARED[:1]
    common = {"page_size": 16, "attention_backend": "triton"}
    cluster = PDCluster(model, "tcp", prefills=[{**common, "chunked_prefill_size": 64}],
                        decodes=[common])
    try:
        assert all(e.describe()["attention_backend"] == "triton" for e in cluster.engines)
        run_pass(cluster, 0, model, "cold", n=6, prompts=prompts)
        run_pass(cluster, 0, model, "warm", n=6, prompts=prompts)
        assert cluster.prefills[0].kv.cache.hit_tokens > 0
    finally:
        cluster.close()
