"""`pdserve demo`: the main job. `up` (smollm2-135m, 1P1D by default), a short load test
through the router with the load-test harness, a TTFT/TPOT summary, a clean shutdown.
Exit 0 when every request of the load test succeeded."""

from __future__ import annotations

import asyncio
import sys
import time

import httpx

from pdserve.ports import PortInUse
from pdserve.stack.config import DemoConfig
from pdserve.stack.lifecycle import Stop, stop_on_signals
from pdserve.stack.stack import Stack, StackError
from pdserve.stack.up import print_urls, say


def bench_config(cfg: DemoConfig, base_url: str):
    from pdserve.loadtest.config import BenchConfig

    s = cfg.stack
    bc = BenchConfig(base_url=base_url, backend=cfg.backend, tokenizer=s.model,
                     num_prompts=cfg.num_prompts, random_input_len=cfg.input_len,
                     random_output_len=cfg.output_len, request_rate=cfg.request_rate,
                     max_concurrency=cfg.max_concurrency, warmup_requests=1,
                     output_file=cfg.output_file, label=f"{s.prefill}P{s.decode}D",
                     request_timeout=300.0, disable_tqdm=not sys.stderr.isatty())
    return bc  # validated when built (BenchConfig.__post_init__)


def load_test(cfg: DemoConfig, base_url: str) -> dict:
    from pdserve.loadtest import report
    from pdserve.loadtest.runner import bench

    bc = bench_config(cfg, base_url)
    rows: list[dict] = []

    def on_run(outcome) -> None:
        rows.append(report.result_row(outcome))
        print(report.format_table(rows[-1]), flush=True)
        if bc.output_file:
            report.append_jsonl(bc.output_file, rows[-1])

    say(f"pdserve demo: load test: {cfg.num_prompts} requests at {cfg.request_rate:g}/s "
        f"(at most {cfg.max_concurrency or 'unbounded'} in flight), {cfg.input_len} prompt "
        f"tokens, {cfg.output_len} output tokens, via {cfg.backend}")
    asyncio.run(bench(bc, on_run))
    return rows[-1]


def summary(row: dict, legs: dict[str, int], cfg: DemoConfig) -> str:
    def ms(key: str) -> str:
        value = row.get(key)
        return "-" if value is None else f"{value:.0f}"

    lines = [f"pdserve demo: {row['completed']}/{row['num_prompts']} requests ok in "
             f"{row['duration']:.1f}s through {cfg.stack.prefill}P{cfg.stack.decode}D "
             f"({cfg.stack.model}), {row['output_throughput']:.1f} output tok/s"]
    for metric in ("ttft", "tpot"):
        lines.append(f"  {metric.upper()} ms   mean {ms(f'mean_{metric}_ms'):>6}   "
                     f"p50 {ms(f'median_{metric}_ms'):>6}   p90 {ms(f'p90_{metric}_ms'):>6}"
                     f"   p99 {ms(f'p99_{metric}_ms'):>6}")
    if legs:
        lines.append("  requests per node (warm-up included): "
                     + ", ".join(f"{k} {v}" for k, v in sorted(legs.items())))
    return "\n".join(lines)


def legs_per_node(router_url: str) -> dict[str, int]:
    try:
        nodes = httpx.get(f"{router_url}/nodes", timeout=5, trust_env=False).json()["nodes"]
    except (httpx.HTTPError, ValueError, KeyError):
        return {}
    return {n["node_id"]: n["legs"].get("ok", 0) for n in nodes}


def run_demo(cfg: DemoConfig) -> int:
    stack = Stack(cfg.stack, say)
    code = 1
    with stop_on_signals():
        try:
            started = time.monotonic()
            say(f"pdserve demo: starting {cfg.stack.prefill}P{cfg.stack.decode}D of "
                f"{cfg.stack.model} (logs in {stack.log_dir})")
            stack.start()
            print_urls(stack, started, "pdserve demo")
            row = load_test(cfg, stack.router_url)
            say(summary(row, legs_per_node(stack.router_url), cfg))
            code = 0 if row["failed"] == 0 else 1
        except Stop as sig:
            say(f"pdserve demo: {sig}, stopping")
            code = 130
        except (StackError, PortInUse) as exc:
            print(f"pdserve demo: error: {exc}", file=sys.stderr, flush=True)
            code = 2 if isinstance(exc, PortInUse) else 1
        finally:
            stack.stop()
    say("pdserve demo: stopped")
    return code
