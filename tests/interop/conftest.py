"""Fixtures of the interop tests: a real registry and real pdserve prefill/decode nodes
(tiny-llama, tcp transfer) shared by the module, with SGLang's router in front."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch
from sglang_harness import (
    DECODE_FLAGS,
    MODEL,
    PREFILL_FLAGS,
    Node,
    Proc,
    Registry,
    SGLangRouter,
    wait_for_port,
)


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    # The offline reference engine shares a small machine with four node processes.
    torch.set_num_threads(int(os.environ.get("PDSERVE_TEST_THREADS", "1")))


class Cluster:
    def __init__(self, log_dir) -> None:
        self.log_dir = log_dir
        self.registry = Registry(log_dir)
        self.prefills: list[Node] = []
        self.decodes: list[Node] = []
        self.routers: list[Proc] = []

    def start(self, n_prefill: int, n_decode: int) -> Cluster:
        self.registry.start()
        self.prefills = [Node("prefill", "tcp", self.registry, self.log_dir, MODEL,
                              PREFILL_FLAGS) for _ in range(n_prefill)]
        self.decodes = [Node("decode", "tcp", self.registry, self.log_dir, MODEL, DECODE_FLAGS)
                        for _ in range(n_decode)]
        for node in self.prefills + self.decodes:  # all at once: start-up is mostly imports
            node.spawn()
        for node in self.prefills + self.decodes:
            node.wait_ready()
        return self

    def router(self, prefills: list[Node], decodes: list[Node], *flags: str) -> SGLangRouter:
        r = SGLangRouter(prefills, decodes, self.log_dir, flags)
        self.routers.append(r)
        return r.start()

    def pdserve_router(self) -> str:
        """pdserve's own router over the same registry; its URL once healthy."""
        proc = Proc("pdserve-router", [], self.log_dir)
        proc.cmd = [sys.executable, "-m", "pdserve.cli", "router", "--registry",
                    self.registry.url, "--port", "0", "--port-file", str(proc.port_file),
                    "--log-level", "warning"]
        self.routers.append(proc)
        proc.spawn()
        return f"http://127.0.0.1:{wait_for_port(proc, 240)}"  # once /health answers 200

    def close(self) -> None:
        for proc in [*self.routers, *self.prefills, *self.decodes, self.registry]:
            proc.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    """2 prefill + 2 decode nodes; the tests put routers over all or part of them."""
    c = Cluster(tmp_path_factory.mktemp("interop"))
    try:
        yield c.start(2, 2)
    finally:
        c.close()
