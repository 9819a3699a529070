"""Start-up refusal of transfer set-ups that cannot work (kv_transfer/compat.py): the pure
decision on injected facts, and the real `pdserve prefill` command refusing a CUDA KV pool
with the non-CUDA Mooncake build installed here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kv_transfer.compat import TransferFacts, installed_mooncake_builds, transfer_refusal


def facts(**kw) -> TransferFacts:
    base = dict(kv_device="cuda", backend="mooncake", mooncake_builds=("cuda13",),
                mooncake_error=None, torch_cuda="13.0")
    return TransferFacts(**(base | kw))


@pytest.mark.parametrize("kw", [
    {},  # CUDA 13 build, torch on CUDA 13
    {"mooncake_builds": ("cuda12",), "torch_cuda": "12.8"},
    {"kv_device": "cpu", "mooncake_builds": ("non-cuda",)},
    {"kv_device": "cpu", "mooncake_builds": ("cuda13",), "torch_cuda": None},
    {"mooncake_builds": ()},  # importable build of unknown origin (from source)
    {"backend": "tcp", "mooncake_builds": ("non-cuda",)},  # tcp stages through host memory
    {"backend": "tcp", "mooncake_error": "ImportError: x", "mooncake_builds": ()},
])
def test_workable_setups_are_accepted(kw) -> None:
    assert transfer_refusal(facts(**kw)) is None


@pytest.mark.parametrize("kw, words", [
    ({"mooncake_builds": ("non-cuda",)},
     ["on cuda", "mooncake-transfer-engine-non-cuda", "pdserve[cuda]", "--transfer-backend tcp"]),
    ({"mooncake_builds": ("cuda12",), "torch_cuda": "13.0"},
     ["cuda12", "CUDA 13.0", "mooncake-transfer-engine-cuda13"]),
    ({"mooncake_error": "OSError: libibverbs.so.1"},
     ["unavailable", "libibverbs.so.1", "pdserve[cuda]", "--transfer-backend tcp"]),
    ({"kv_device": "cpu", "mooncake_error": "ImportError: no mooncake", "mooncake_builds": ()},
     ["unavailable", "pdserve[mooncake]", "--transfer-backend tcp"]),
    ({"mooncake_builds": ("non-cuda", "cuda13")}, ["several Mooncake builds", "uninstall"]),
])
def test_impossible_setups_are_refused_naming_the_fix(kw, words) -> None:
    msg = transfer_refusal(facts(**kw))
    assert msg is not None and "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_installed_build_is_detected_from_the_distribution_name() -> None:
    # This machine has the non-CUDA wheel (pyproject's `mooncake` extra).
    assert installed_mooncake_builds() == ("non-cuda",)


@pytest.mark.timeout(120)
def test_node_refuses_cuda_kv_with_non_cuda_mooncake() -> None:
    cmd = [sys.executable, "-m", "pdserve.cli", "prefill", "--model", "tiny-llama",
           "--device", "cuda", "--registry", "http://127.0.0.1:9", "--port", "39871"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=os.environ)
    assert res.returncode != 0
    err = res.stderr.strip().splitlines()
    assert len(err) == 1, res.stderr  # one clear line, no traceback
    assert "cannot register GPU memory" in err[0] and "pdserve[cuda]" in err[0], err


@pytest.mark.parametrize("node_args, want", [
    ("--device cuda --max-running-requests 8", "tcp"),  # non-CUDA Mooncake: tcp, with why
    ("--device=cuda:0", "tcp"),
    ("--device cpu", "mooncake"),
    ("", "mooncake"),  # auto = cpu on this machine
])
def test_pdserve_up_picks_tcp_for_gpu_nodes_without_cuda_mooncake(tmp_path, node_args,
                                                                   want) -> None:
    from pdserve.stack.config import StackConfig
    from pdserve.stack.stack import Stack

    said: list[str] = []
    stack = Stack(StackConfig(model="tiny-llama", node_args=node_args,
                              log_dir=str(tmp_path)), said.append)
    try:
        assert stack._default_backend() == want
    finally:
        stack.http.close()
    if want == "tcp":
        assert "cannot register GPU memory" in said[0], said
