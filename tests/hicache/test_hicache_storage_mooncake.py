"""HiCache's storage tier on a real Mooncake Store (`mooncake_master` from the Mooncake wheel):
objects round-trip between two clients bit-exact, a damaged object is refused, a second
engine reads the pages the first computed and both equal transformers, and a node whose
master is unreachable serves without the tier and says so."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hf_reference import hf_greedy

from pdserve import LLM, SamplingParams
from pdserve.cache.kv_storage import MooncakeStorage
from pdserve.ports import free_port, refusing_port

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny-llama"


def master_binary() -> str:
    found = shutil.which("mooncake_master") or str(Path(sys.executable).parent /
                                                  "mooncake_master")
    assert Path(found).exists(), "mooncake_master (in the Mooncake wheel) is not installed"
    return found


@pytest.fixture(scope="module")
def master(tmp_path_factory) -> Iterator[tuple[str, str]]:
    # free_port: mooncake_master (not our server) takes no port 0 and reports none.
    rpc, http = free_port(), free_port()
    log = tmp_path_factory.mktemp("mooncake") / "master.log"
    proc = subprocess.Popen([master_binary(), "--enable_http_metadata_server=true",
                             f"--http_metadata_server_port={http}", f"--rpc_port={rpc}"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{http}/metadata"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url, params={"key": "probe"}, timeout=1)
            socket.create_connection(("127.0.0.1", rpc), timeout=1).close()
            break
        except (httpx.HTTPError, OSError):
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"mooncake_master did not start: {log.read_text()[-2000:]}") \
                    from None
            time.sleep(0.2)
    try:
        yield f"127.0.0.1:{rpc}", url
    finally:
        proc.terminate()
        proc.wait(10)


def client(master: tuple[str, str]) -> MooncakeStorage:
    st = MooncakeStorage(master[0], master[1], "127.0.0.1", 64, "tcp")
    deadline = time.monotonic() + 60
    while not st.up:
        assert time.monotonic() < deadline, "no connection to the Mooncake master"
        time.sleep(0.1)
    return st


def test_objects_round_trip_between_two_clients(master):
    a, b = client(master), client(master)
    try:
        payload = random.Random(1).randbytes(300_000)
        assert not b.exists("k1") and b.get("k1") is None
        a.put("k1", payload)
        assert b.exists("k1") and b.get("k1") == payload
        assert a._store.put("k2", b"not a pdserve object") == 0  # written around the checks
        with pytest.raises(ValueError):
            b.get("k2")
    finally:
        a.close()
        b.close()


def test_second_engine_reads_what_the_first_computed(master):
    rng = random.Random(3)
    ids = [rng.randrange(100, 30000) for _ in range(200)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    kw = dict(max_total_tokens=1024, enable_hierarchical_cache=True,
              hicache_storage_backend="mooncake", hicache_mooncake_master=master[0],
              hicache_mooncake_metadata_url=master[1], hicache_mooncake_segment_mb=64)
    engines = []
    try:
        outs = []
        for _ in range(2):  # both stay up: the store keeps objects in its clients' segments
            llm = LLM(MODEL, **kw)
            engines.append(llm)
            deadline = time.monotonic() + 60
            while not llm.engine.page_store.storage.up:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            outs.append(llm.generate([ids], params)[0].output_ids)
            llm.engine.kv.drain_copies()
        s1 = engines[0].engine.hicache_stats()["storage"]
        s2 = engines[1].engine.hicache_stats()["storage"]
        assert s1["storage_written_pages"] > 0 and s1["storage_hit_pages"] == 0
        assert s2["storage_hit_pages"] == s1["storage_written_pages"], (s1, s2)
        assert s2["storage_up"] == 1
        assert outs[0] == outs[1] == list(hf_greedy(MODEL, tuple(ids), 6))
        for llm in engines:
            llm.engine.kv.cache.reset()
            assert llm.engine.pools_full()
    finally:
        for llm in engines:
            llm.close()


def test_unreachable_master_serves_without_the_tier():
    with refusing_port() as master, refusing_port() as meta:  # nothing listens there
        dead = f"127.0.0.1:{master}"
        llm = LLM(MODEL, max_total_tokens=1024, enable_hierarchical_cache=True,
                  hicache_storage_backend="mooncake", hicache_mooncake_master=dead,
                  hicache_mooncake_metadata_url=f"http://127.0.0.1:{meta}/metadata")
        try:
            ids = list(range(300, 500))
            out = llm.generate([ids], SamplingParams(max_new_tokens=4, temperature=0.0,
                                                     ignore_eos=True))[0].output_ids
            assert out == list(hf_greedy(MODEL, tuple(ids), 4))
            llm.engine.kv.drain_copies()
            st = llm.engine.hicache_stats()["storage"]
            assert st["storage_up"] == 0 and st["storage_errors"] >= 1, st
            assert st["storage_written_pages"] == 0
            assert llm.engine.describe()["hicache"]["storage"]["master"] == dead
        finally:
            llm.close()
