"""Drive a bench: set up once (server info, tokenizer, prompts, warmup), then one timed run
per request rate. Request failures are data, not exceptions; only a setup problem that makes
the whole bench meaningless raises `BenchError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from pdserve.loadtest import server_info
from pdserve.loadtest.arrivals import arrival_times
from pdserve.loadtest.backends import RequestSpec
from pdserve.loadtest.client import send_request
from pdserve.loadtest.config import BenchConfig
from pdserve.loadtest.dataset import Prompt, build_prompts
from pdserve.loadtest.metrics import RequestResult
from pdserve.loadtest.tokenizer import BenchTokenizer, load_tokenizer, try_load_tokenizer
from pdserve.loadtest.trace_breakdown import TracedRequest, breakdown
from pdserve.loadtest.trace_receiver import SpanReceiver


class BenchError(RuntimeError):
    """The bench cannot start (e.g. no tokenizer where one is needed, unreadable dataset)."""


@dataclass(frozen=True)
class Setup:
    prompts: list[Prompt]
    spec: RequestSpec
    tokenizer: BenchTokenizer | None
    models: dict


@dataclass
class RunOutcome:
    """One timed run at one request rate."""

    cfg: BenchConfig
    results: list[RequestResult]
    duration: float
    model: str
    tokenizer: str
    server: dict = field(default_factory=dict)
    trace_breakdown: dict | None = None  # --trace-breakdown (pdserve.loadtest.trace_breakdown)


def note(msg: str) -> None:
    print(f"pdserve bench: {msg}", file=sys.stderr, flush=True)


KEEPALIVE_S = 4.0


def new_client(cfg: BenchConfig) -> httpx.AsyncClient:
    # trust_env=False: a proxy from the environment must not sit between bench and server.
    # Connections are kept alive for the next request (client.py reads each response to its
    # end): as many idle ones are kept as requests may be in flight (--max-concurrency;
    # unbounded without it). No cap on open ones: a request never waits for the pool.
    # Idle ones are dropped after 4 s, below uvicorn's 5 s keep-alive (the servers'), so a
    # request is not sent on a connection the server is closing.
    limits = httpx.Limits(max_connections=None,
                          max_keepalive_connections=cfg.max_concurrency or None,
                          keepalive_expiry=KEEPALIVE_S)
    return httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout), limits=limits,
                             trust_env=False)


def pick_tokenizer(cfg: BenchConfig, model: str) -> BenchTokenizer | None:
    if cfg.tokenizer:
        try:
            return load_tokenizer(cfg.tokenizer)
        except Exception as exc:  # any loader failure is a bad --tokenizer value
            raise BenchError(f"--tokenizer {cfg.tokenizer!r}: {exc}") from exc
    tok, problems = try_load_tokenizer([model])
    if problems:
        note(f"no tokenizer from the served model's name ({problems[0]})")
    return tok


async def prepare(cfg: BenchConfig, client: httpx.AsyncClient) -> Setup:
    models = await server_info.fetch_models(client, cfg.base_url)
    model = cfg.model or server_info.first_model_id(models)
    tok = pick_tokenizer(cfg, model)
    # Chat messages are text; /generate and /v1/completions also take token ids.
    needs_text = cfg.backend == "openai-chat" and cfg.dataset_name != "sharegpt"
    if needs_text and tok is None:
        raise BenchError(f"--backend {cfg.backend} with --dataset-name {cfg.dataset_name} "
                         "needs a tokenizer to turn token ids into text: pass --tokenizer "
                         "(a local HF folder or a built-in model name)")
    if tok is None:
        note("no tokenizer (pass --tokenizer for exact prompt lengths); "
             "token counts come from the server")
    try:
        prompts = build_prompts(cfg, tok)
    except ValueError as exc:
        raise BenchError(str(exc)) from exc
    spec = RequestSpec(cfg.backend, model, cfg.temperature, cfg.ignore_eos,
                       cfg.schema_text())
    return Setup(prompts, spec, tok, models)


async def warmup(cfg: BenchConfig, setup: Setup, client: httpx.AsyncClient) -> None:
    """Untimed requests first (compilation, caches, connections), as both reference benches."""
    if not cfg.warmup_requests:
        return
    prompts = [setup.prompts[i % len(setup.prompts)] for i in range(cfg.warmup_requests)]
    start = time.perf_counter()
    results = await asyncio.gather(*(
        send_request(client, cfg.url, setup.spec, p, start, cfg.request_timeout)
        for p in prompts))
    failed = [r.error for r in results if not r.success]
    if failed:
        note(f"{len(failed)}/{len(results)} warmup requests failed (first: {failed[0]})")


def start_receiver(cfg: BenchConfig) -> SpanReceiver:
    """--trace-breakdown's OTLP/HTTP receiver, listening before any request is sent."""
    try:
        receiver = SpanReceiver(cfg.trace_receiver_host, cfg.trace_receiver_port)
    except ImportError as exc:
        raise BenchError(f"--trace-breakdown needs opentelemetry-proto: pip install "
                         f"'pdserve[trace]' ({exc})") from None
    try:
        port = receiver.start()
    except OSError as exc:
        raise BenchError(f"--trace-breakdown: cannot listen on {cfg.trace_receiver_host}:"
                         f"{cfg.trace_receiver_port}: {exc}") from None
    note(f"trace receiver on http://{cfg.trace_receiver_host}:{port}/v1/traces: the servers "
         f"need --otlp-traces-endpoint http://{cfg.trace_receiver_host}:{port}")
    return receiver


def trace_report(cfg: BenchConfig, results: list[RequestResult],
                 receiver: SpanReceiver) -> dict:
    """Wait for the run's spans, then their breakdown (a run whose servers export nothing
    says so instead of failing)."""
    reqs = [TracedRequest(r.trace_id, r.sent_unix_ns,
                          r.sent_unix_ns + int(r.ttft * 1e9) if r.success else None)
            for r in results if r.trace_id]
    spans = receiver.wait_for({r.trace_id for r in reqs}, cfg.trace_wait_s)
    entry = breakdown(reqs, spans)
    if not entry["traced"]:
        note(f"--trace-breakdown: no span arrived in {cfg.trace_wait_s:g}s: were the servers "
             f"started with --otlp-traces-endpoint http://{cfg.trace_receiver_host}:"
             f"{receiver.port}?")
    return entry


async def run_once(cfg: BenchConfig, setup: Setup, client: httpx.AsyncClient,
                   receiver: SpanReceiver | None = None) -> RunOutcome:
    prompts = setup.prompts
    times = arrival_times(len(prompts), cfg.request_rate, cfg.burstiness, cfg.seed)
    gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    count = setup.tokenizer.count if setup.tokenizer else None
    before = await server_info.fetch_metrics(client, cfg.base_url)
    bar = tqdm(total=len(prompts), disable=cfg.disable_tqdm, desc=f"rate {cfg.request_rate:g}",
               unit="req", file=sys.stderr)
    start = time.perf_counter()

    async def one(i: int) -> RequestResult:
        await asyncio.sleep(max(0.0, start + times[i] - time.perf_counter()))
        async with gate or contextlib.nullcontext():
            result = await send_request(client, cfg.url, setup.spec, prompts[i], start,
                                        cfg.request_timeout, count,
                                        secrets.token_hex(16) if receiver else "")
        bar.update(1)
        return result

    results = list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
    duration = time.perf_counter() - start
    bar.close()
    # The node's counters are a periodic snapshot: wait for one taken after the last answer.
    after = await server_info.fetch_metrics_after(client, cfg.base_url, time.time())
    server = {"server_models": setup.models, "server_metrics_before": before,
              "server_metrics_after": after,
              "server_metrics_delta": server_info.metrics_delta(before, after)}
    tok_name = setup.tokenizer.name if setup.tokenizer else ""
    traces = None
    if receiver is not None:
        traces = await asyncio.to_thread(trace_report, cfg, results, receiver)
    return RunOutcome(cfg, results, duration, setup.spec.model, tok_name, server, traces)


async def bench(cfg: BenchConfig, on_run: Callable[[RunOutcome], None]) -> list[RunOutcome]:
    """Every rate of the sweep in turn; `on_run` reports each run as soon as it ends, so a
    long sweep that is interrupted keeps the runs it finished."""
    outcomes = []
    receiver = start_receiver(cfg) if cfg.trace_breakdown else None
    try:
        async with new_client(cfg) as client:
            setup = await prepare(cfg, client)
            await warmup(cfg, setup, client)
            for rate in cfg.rates():
                outcomes.append(await run_once(cfg.with_rate(rate), setup, client, receiver))
                on_run(outcomes[-1])
    finally:
        if receiver is not None:
            receiver.stop()
    return outcomes
