"""A test double of a pdserve node's HTTP front, for the bench's end-to-end tests only.

It streams fake tokens with controlled delays over the docs/architecture.md: Interfaces wire
formats:
`/generate` (cumulative SGLang events), `/v1/completions` and `/v1/chat/completions`
(OpenAI deltas + usage), all ending with `data: [DONE]`. Under `/flaky/...` every 5th
request (by arrival) answers 500 and every 5th+1 breaks its stream mid-way.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

TTFT_S = 0.02  # server-side delay before the first token
ITL_S = 0.005  # delay between tokens
MODEL = "fake-model"


def _sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


class FakeServer:
    """Holds the counters; `app` serves it; `start()`/`stop()` run uvicorn in a thread."""

    def __init__(self) -> None:
        self.requests = 0
        self.flaky_counter = itertools.count()
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def _build_app(self) -> FastAPI:
        app = FastAPI()
        app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": MODEL,
                                                                     "object": "model"}]})
        app.get("/metrics")(self._metrics)
        for prefix in ("", "/flaky"):
            app.post(prefix + "/generate")(self._handler("generate", bool(prefix)))
            app.post(prefix + "/v1/completions")(self._handler("openai", bool(prefix)))
            app.post(prefix + "/v1/chat/completions")(self._handler("chat", bool(prefix)))
        return app

    def _metrics(self):
        from fastapi.responses import PlainTextResponse

        text = ("# TYPE fake_requests_total counter\n"
                f'fake_requests_total{{model="{MODEL}"}} {self.requests}\n'
                'fake_latency_bucket{le="0.1"} 3\n')
        return PlainTextResponse(text)

    def _handler(self, kind: str, flaky: bool):
        async def handle(request: Request):
            body = await request.json()
            self.requests += 1
            turn = next(self.flaky_counter) % 5 if flaky else -1
            if turn == 0:
                return JSONResponse({"error": {"message": "injected failure", "type": "server",
                                               "code": 500}}, status_code=500)
            n_prompt, n_out = _lengths(kind, body)
            events = _events(kind, n_prompt, n_out)
            return StreamingResponse(_paced(events, broken=turn == 1),
                                     media_type="text/event-stream")
        return handle

    def start(self) -> FakeServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="critical", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)


def _lengths(kind: str, body: dict) -> tuple[int, int]:
    if kind == "generate":
        n_prompt = len(body["input_ids"]) if "input_ids" in body else len(body["text"].split())
        return n_prompt, int(body["sampling_params"]["max_new_tokens"])
    if kind == "openai":  # a text prompt, or token ids
        prompt = body["prompt"]
        return len(prompt) if isinstance(prompt, list) else len(prompt.split()), \
            int(body["max_tokens"])
    return len(body["messages"][-1]["content"].split()), int(body["max_tokens"])


def _events(kind: str, n_prompt: int, n_out: int) -> list[dict]:
    """One event per token, then the final usage event for the OpenAI kinds."""
    events = []
    for i in range(n_out):
        last = i == n_out - 1
        finish = "length" if last else None
        if kind == "generate":
            events.append({"text": " tok" * (i + 1), "output_ids": list(range(100, 101 + i)),
                           "meta_info": {"id": "r", "prompt_tokens": n_prompt,
                                         "completion_tokens": i + 1, "cached_tokens": 0,
                                         "finish_reason": finish}})
        elif kind == "openai":
            events.append({"choices": [{"index": 0, "text": " tok", "finish_reason": finish}]})
        else:
            events.append({"choices": [{"index": 0, "delta": {"content": " tok"},
                                        "finish_reason": finish}]})
    if kind != "generate":
        events.append({"choices": [], "usage": {"prompt_tokens": n_prompt,
                                                "completion_tokens": n_out,
                                                "total_tokens": n_prompt + n_out}})
    return events


async def _paced(events: list[dict], broken: bool):
    await asyncio.sleep(TTFT_S)
    for i, event in enumerate(events):
        if i:
            await asyncio.sleep(ITL_S)
        if broken and i == 2:
            raise RuntimeError("injected broken stream")  # uvicorn drops the connection
        yield _sse(event)
    yield b"data: [DONE]\n\n"
