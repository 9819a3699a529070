"""HiCache flags: bad values are a clear CLI error with exit != 0; the host tier's numbers
reach the node's /metrics rendering and the /server_info stats message."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.config import EngineConfig


@pytest.mark.parametrize("flags, message", [
    (["--hicache-ratio", "0"], "hicache_ratio must be > 0"),
    (["--hicache-ratio", "-1.5"], "hicache_ratio must be > 0"),
    (["--hicache-write-policy", "write_sometimes"], "hicache_write_policy must be one of"),
    (["--hicache-size", "1000000"], "does not fit this machine's memory"),
    (["--hicache-storage-backend", "file"], "needs --hicache-storage-path"),
    (["--hicache-storage-backend", "s3"], "hicache_storage_backend must be file"),
])
def test_bad_hicache_flags_exit_nonzero(flags, message):
    cmd = [sys.executable, "-m", "pdserve.cli", "generate", "--model", "tiny-llama",
           "--enable-hierarchical-cache", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=os.environ)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


def test_flags_in_help_and_config():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=120).stdout
    for flag in ("--enable-hierarchical-cache", "--hicache-ratio", "--hicache-size",
                 "--hicache-write-policy"):
        assert flag in out
    cfg = EngineConfig(enable_hierarchical_cache=True, hicache_ratio=0.5,
                       hicache_write_policy="write_back")
    assert cfg.hicache_ratio == 0.5


def test_storage_tier_needs_hicache():
    with pytest.raises(ValueError, match="needs --enable-hierarchical-cache"):
        EngineConfig(hicache_storage_backend="file", hicache_storage_path="/tmp/x")


def test_storage_metrics_render(tmp_path):
    """The storage tier's counters reach /metrics and /server_info names the backend."""
    from pdserve import LLM, SamplingParams
    from pdserve.node import messages as m
    from pdserve.node.metrics import Metrics

    llm = LLM("tiny-llama", max_total_tokens=256, enable_hierarchical_cache=True,
              hicache_storage_backend="file", hicache_storage_path=str(tmp_path))
    try:
        llm.generate([list(range(200, 300))], SamplingParams(max_new_tokens=2, temperature=0.0))
        llm.engine.kv.drain_copies()
        h = llm.engine.hicache_stats()
        assert h["storage"]["storage_written_pages"] > 0
        assert llm.engine.describe()["hicache"]["storage"] == {"backend": "file",
                                                                "path": str(tmp_path)}
        stats = m.decode(m.encode(m.Stats(0, 0, 0.0, 0.0, 1, 1, 1, 1, True, {}, 0, 0,
                                          hicache=h)))
        text = Metrics(lambda: stats).render().decode()
        line = next(x for x in text.splitlines()
                    if x.startswith("pdserve_hicache_storage_written_pages_total "))
        assert float(line.split()[-1]) == h["storage"]["storage_written_pages"]
        assert "pdserve_hicache_storage_corrupt_pages_total 0.0" in text
        count = "pdserve_hicache_storage_write_latency_seconds_count "
        line = next(x for x in text.splitlines() if x.startswith(count))
        assert float(line.split()[-1]) >= 1, line  # a write per backup that stored pages
    finally:
        llm.close()


def test_hicache_metrics_render():
    from pdserve import LLM, SamplingParams
    from pdserve.node import messages as m
    from pdserve.node.metrics import Metrics

    llm = LLM("tiny-llama", max_total_tokens=256, enable_hierarchical_cache=True,
              hicache_ratio=3)
    try:
        doc = list(range(200, 300))
        params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
        llm.generate([doc + [1]], params)
        assert llm.engine.pools_full()
        llm.engine.kv.cache.evict(llm.engine.kv.cache.total_pages)
        llm.generate([doc + [2]], params)
        h = llm.engine.hicache_stats()
        assert h["host_total_pages"] == 3 * llm.engine.kv_pool.num_pages
        assert h["host_hit_tokens"] >= 96 and h["load_bytes"] > 0 and h["backup_bytes"] > 0
        assert h["device_evictions"] > 0
        stats = m.decode(m.encode(m.Stats(0, 0, 0.0, 0.0, 1, 1, 1, 1, True, {}, 0, 0,
                                          hicache=h)))
        text = Metrics(lambda: stats).render().decode()
        for name in ("pdserve_hicache_host_total_pages", "pdserve_hicache_host_used_pages",
                     "pdserve_hicache_host_hit_tokens_total", "pdserve_hicache_load_bytes_total",
                     "pdserve_hicache_backup_bytes_total",
                     'pdserve_hicache_evictions_total{tier="device"}'):
            assert name in text, name
        for kind in ("backup", "load"):  # latency histograms, submit to done
            count = f"pdserve_hicache_{kind}_latency_seconds_count "
            line = next(x for x in text.splitlines() if x.startswith(count))
            assert float(line.split()[-1]) == h[f"{kind}_ops"] > 0, line
            assert f'pdserve_hicache_{kind}_latency_seconds_bucket{{le="+Inf"}}' in text
    finally:
        llm.close()
