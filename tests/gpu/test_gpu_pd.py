"""1P1D on one GPU: a real registry and real `pdserve prefill|decode --device cuda` node
processes over HTTP; KV moves between the two processes' GPU pools over tcp (through the
pinned bounce buffers, CRC on) and over Mooncake when its CUDA build imports here. Greedy
output equals the colocated engine on cuda; every pool is back to full afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pd_pair import random_prompt
from pd_procs import Node, PDRequest, Registry

from kv_transfer.compat import installed_mooncake_builds
from pdserve import LLM, SamplingParams

pytestmark = pytest.mark.timeout(600)
MODEL = "tiny-llama"
FLAGS = ["--device", "cuda", "--dtype", "float32", "--max-total-tokens", "8192",
         "--kv-checksum", "--kv-transfer-timeout-s", "60"]
GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}


def _mooncake_cuda_problem() -> str | None:
    builds = installed_mooncake_builds()
    if not any(b.startswith("cuda") for b in builds):
        return f"no CUDA build of Mooncake installed (found {builds or 'none'})"
    from kv_transfer import mooncake_import_error

    return mooncake_import_error()


def _backends() -> list:
    problem = _mooncake_cuda_problem()
    mooncake = pytest.param("mooncake", marks=pytest.mark.skipif(
        problem is not None, reason=f"Mooncake CUDA build does not import: {problem}"))
    return ["tcp", mooncake]


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Iterator[tuple[Registry, object]]:
    log_dir = tmp_path_factory.mktemp("gpu-pd")
    reg = Registry(log_dir)
    try:
        reg.start()
        yield reg, log_dir
    finally:
        reg.stop()


@pytest.fixture(scope="module")
def reference() -> Iterator[LLM]:
    llm = LLM(MODEL, device="cuda", dtype="float32", max_total_tokens=8192)
    yield llm
    llm.close()


@pytest.mark.parametrize("backend", _backends())
def test_1p1d_on_one_gpu_token_exact(registry, reference, backend: str) -> None:
    reg, log_dir = registry
    nodes = [Node(role, backend, reg, log_dir, MODEL, FLAGS) for role in ("prefill", "decode")]
    try:
        for n in nodes:
            n.spawn()
        prefill, decode = (n.wait_ready() for n in nodes)
        prompts = [random_prompt(n, seed=7000 + n) for n in (1, 17, 64, 150, 300)]
        want = [o.output_ids for o in reference.generate(
            prompts, SamplingParams(**GREEDY))]
        reqs = [PDRequest(prefill, decode, p, GREEDY, stream=i % 2 == 1).start()
                for i, p in enumerate(prompts)]
        for r in reqs:
            r.join(timeout=300)
        for r, w in zip(reqs, want, strict=True):
            assert r.prefill.status == 200 and r.decode.status == 200, (r.prefill, r.decode)
            body = r.decode.events[-2] if r.decode.events else r.decode.body
            assert body["output_ids"] == w
        stats = decode.wait_pools_full(timeout=30)["role"]["transfer"]
        assert stats["rooms_succeeded"] >= len(prompts)
        assert stats["checksum_failures"] == 0 and stats["bytes_received"] > 0
        prefill.wait_pools_full(timeout=30)
        for n in (prefill, decode):
            assert n.info()["engine"]["device"].startswith("cuda"), n.info()["engine"]
    finally:
        for n in nodes:
            n.stop()
