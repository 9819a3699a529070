"""Fixtures of the node-server tests: one live `pdserve serve` on tiny-llama shared by the
session (machinery in server_harness.py), and the offline engine as the reference."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from server_harness import MODEL, Server, sse_events

from pdserve import LLM, SamplingParams


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default node, shared by every test that does not need special flags. Its
    teardown is itself a check: Ctrl-C (SIGINT to the whole process group, as a terminal
    sends it) during a short streaming request lets that request finish, then exits
    cleanly, leaving no process and no IPC file behind."""
    srv = Server(log_dir=tmp_path_factory.mktemp("server")).start()
    try:
        yield srv
        served = srv.log()
        # 60 tokens: still streaming when the signal comes (the first arrived), and done
        # well within the node's 10 s graceful shutdown even on a loaded 2-core machine.
        in_flight = InFlight(srv, max_new_tokens=60)
        in_flight.mark_signal()
        rc = srv.terminate(sig=signal.SIGINT, group=True)
        problems = in_flight.problems()
        if "Traceback" in served:  # a handler blew up during the session
            problems.append("traceback while serving:\n" +
                            served[served.index("Traceback"):][:4000])
        # exit 0, or dead by SIGINT / 130, as an interrupted program may report it
        problems += srv.exit_problems(rc, (0, -signal.SIGINT, 128 + signal.SIGINT), served)
        assert not problems, "after Ctrl-C: " + "\n".join(problems)
    finally:
        srv.stop()


class InFlight:
    """A streaming /generate request running in a thread; started when constructed, it
    has produced its first tokens when the constructor returns."""

    def __init__(self, srv: Server, max_new_tokens: int) -> None:
        self.n = max_new_tokens
        self.lines: list[str] = []
        self.errors: list[BaseException] = []
        self.done_at_signal = False
        self.thread = threading.Thread(target=self._run, args=(srv,))
        self.thread.start()
        deadline = time.monotonic() + 20
        while len(self.lines) < 2 and not self.errors and time.monotonic() < deadline:
            time.sleep(0.01)

    def _run(self, srv: Server) -> None:
        body = {"text": "in flight", "stream": True, "sampling_params": {
            "max_new_tokens": self.n, "temperature": 0, "ignore_eos": True}}
        try:
            with httpx.stream("POST", f"{srv.url}/generate", json=body, timeout=60) as r:
                self.lines.extend(ln for ln in r.iter_lines() if ln.strip())
        except BaseException as exc:  # reported by problems()
            self.errors.append(exc)

    def mark_signal(self) -> None:
        """Note whether the request is still streaming as the signal is about to go."""
        self.done_at_signal = "data: [DONE]" in self.lines

    def problems(self) -> list[str]:
        self.thread.join(60)
        if self.thread.is_alive() or self.errors:
            return [f"in-flight request: {self.errors or 'hangs'}"]
        if self.done_at_signal:
            return ["the in-flight request had finished before the signal: proves nothing"]
        events = sse_events(self.lines)
        if events[-1] != "[DONE]" or events[-2]["meta_info"]["completion_tokens"] != self.n:
            return [f"in-flight request not drained: ends with {self.lines[-2:]}"]
        return []


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                       timeout=120) as c:
        yield c


class Offline:
    """The offline engine with the server's defaults: what a greedy request must produce."""

    def __init__(self) -> None:
        torch.set_num_threads(1)  # leave the other core to the server under test
        self.llm = LLM(MODEL)
        self.tokenizer = self.llm.tokenizer

    def encode(self, text: str) -> list[int]:
        """How the server encodes a completion prompt / a /generate text."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """How the server encodes a chat request."""
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True,
                                                 add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def generate(self, prompts: list, **params):
        params.setdefault("temperature", 0.0)
        return self.llm.generate(prompts, SamplingParams(**params))

    def greedy(self, prompt, max_new_tokens: int, **params):
        return self.generate([prompt], max_new_tokens=max_new_tokens, **params)[0]

    def greedy_batch(self, prompts: list, max_new_tokens: list[int]):
        """Greedy outputs of many prompts, run as one continuous batch."""
        params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in max_new_tokens]
        return self.llm.generate(prompts, params)


@pytest.fixture(scope="session")
def offline() -> Iterator[Offline]:
    ref = Offline()
    yield ref
    ref.llm.close()
