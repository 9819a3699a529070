"""Fixtures of the router tests: one `pdserve up` (1 prefill, 2 decode nodes on tiny-llama)
shared by the session, the node launcher that adds PD nodes to its registry, and the
offline engine as the reference for greedy outputs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from router_harness import MODEL, Node, RouterProc, Up

NodeLauncher = Callable[..., dict[str, Node]]
# A router with tight limits and without --model (it learns the model from the registry);
# test_router_limits.py names the two timeouts again.
TIGHT_ROUTER_FLAGS = ("--max-running-requests", "1", "--max-queued-requests", "1",
                      "--queue-timeout-s", "2", "--request-timeout-s", "4")


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """`pdserve up --prefill 1 --decode 2`, shared by the session; no test stops it
    (test_stack_cli checks SIGTERM on a stack of its own)."""
    log_dir = tmp_path_factory.mktemp("up")
    up = Up(log_dir)
    up.start()
    # test_router_limits' second router starts now, so that its start-up (importing
    # transformers) overlaps the loading of the offline engine instead of adding to it.
    up.tight_router = RouterProc(up.registry, log_dir, *TIGHT_ROUTER_FLAGS).spawn()
    try:
        yield up
    finally:
        up.tight_router.terminate()
        up.stop()


@pytest.fixture(scope="session")
def router(stack: Up) -> str:
    return stack.router


@pytest.fixture
def client(router: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{router}/v1", api_key="x", max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def launch_nodes(stack: Up, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeLauncher]:
    """The node launcher: `launch_nodes((role, node_id, *flags), ...)` starts PD nodes
    into the stack's registry side by side and returns them once all are healthy and
    registered; every node is stopped (or found killed) at the end of the module."""
    started: list[Node] = []
    log_dir: Path = tmp_path_factory.mktemp("nodes")

    def launch(*specs: tuple[str, ...]) -> dict[str, Node]:
        nodes = [Node(role, node_id, stack.registry, log_dir, *flags)
                 for role, node_id, *flags in specs]
        started.extend(nodes)
        for node in nodes:
            node.spawn()
        return {node.node_id: node.wait_ready() for node in nodes}

    yield launch
    for node in started:
        node.stop()


class Offline:
    """The offline engine: what a greedy request through the router must produce."""

    def __init__(self) -> None:
        import torch

        from pdserve import LLM

        torch.set_num_threads(1)  # leave the cores to the stack under test
        self.llm = LLM(MODEL)
        self.tokenizer = self.llm.tokenizer

    def chat_ids(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True,
                                                 add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def greedy(self, prompts: list, max_new_tokens: int, **params) -> list:
        from pdserve import SamplingParams

        params.setdefault("temperature", 0.0)
        return self.llm.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens,
                                                         **params))


@pytest.fixture(scope="session")
def offline() -> Iterator[Offline]:
    ref = Offline()
    yield ref
    ref.llm.close()
