"""A run's JSONL record (vLLM field names), its summary table, and the JSONL file itself.

One line per run, appended, so a sweep or repeated runs accumulate in one file that
`pdserve bench compare` and vLLM-aware tooling read back.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from pdserve.loadtest.metrics import percentile_key, summarize
from pdserve.loadtest.runner import RunOutcome

# Per-request arrays in every record (aligned with the requests; null where undefined).
ARRAY_KEYS = ("input_lens", "output_lens", "ttfts", "tpots", "e2els", "cached_lens", "errors")
# The run-level keys every record has (the schema test pins these).
SUMMARY_KEYS = ("date", "label", "backend", "model_id", "tokenizer_id", "num_prompts",
                "request_rate", "burstiness", "max_concurrency", "completed", "failed",
                "duration", "total_input_tokens", "total_output_tokens", "total_cached_tokens",
                "request_throughput", "request_goodput", "output_throughput",
                "total_token_throughput", "concurrency", "max_concurrent_requests")


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def request_arrays(out: RunOutcome) -> dict:
    rs = out.results
    arrays = {
        "input_lens": [r.prompt_len for r in rs],
        "output_lens": [r.output_len if r.success else 0 for r in rs],
        "ttfts": [_round(r.ttft) if r.success else None for r in rs],
        "tpots": [_round(r.tpot) if r.success else None for r in rs],
        "e2els": [_round(r.e2el) if r.success else None for r in rs],
        "cached_lens": [r.cached_tokens if r.success else None for r in rs],
        "errors": [r.error for r in rs],
    }
    if out.cfg.save_detailed:
        arrays["itls"] = [[_round(g) for g in r.itl] for r in rs]
        arrays["start_times"] = [_round(r.start) for r in rs]
        arrays["generated_texts"] = [r.generated_text for r in rs]
    return arrays


def result_row(out: RunOutcome) -> dict:
    cfg = out.cfg
    row: dict = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "label": cfg.run_label,
        "backend": cfg.backend,
        "model_id": out.model,
        "tokenizer_id": out.tokenizer,
        "num_prompts": len(out.results),
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency or None,
    }
    row.update(summarize(out.results, out.duration, cfg.percentiles, cfg.slos_ms()))
    for key, value in cfg.as_record().items():  # the run's arguments
        row.setdefault(key, value)
    row.update(out.server)
    row.update(request_arrays(out))
    if out.trace_breakdown is not None:
        row["trace_hops"] = out.trace_breakdown  # the flag itself is "trace_breakdown"
    return row


def append_jsonl(path: str | Path, row: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row, allow_nan=False) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not a JSON line ({exc})") from exc
    return rows


def rate_of(row: dict) -> float:
    rate = row.get("request_rate", "inf")
    return math.inf if rate in ("inf", None) else float(rate)


def row_stat(row: dict, metric: str, p: float | None) -> float | None:
    """Median (p=None) or percentile of a metric in ms: the stored key, else the arrays."""
    key = f"median_{metric}_ms" if p is None else f"{percentile_key(p)}_{metric}_ms"
    if key in row:
        return row[key] if row.get("completed") else None
    stored = row.get(f"{metric}s") or []
    if metric == "itl":  # per-request lists (only with --save-detailed)
        stored = [gap for gaps in stored for gap in gaps or []]
    values = [v for v in stored if v is not None]
    if not values:
        return None
    return float(np.percentile(np.asarray(values) * 1000.0, 50 if p is None else p))


# ---- the per-run table, in vLLM's layout --------------------------------------------------

def _line(name: str, value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{name:<40} {value!s:<10}"


def _section(title: str) -> str:
    return f"{title:-^50}"


LATENCY_TITLES = {"ttft": ("Time to First Token", "TTFT"),
                  "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
                  "itl": ("Inter-token Latency", "ITL"),
                  "e2el": ("End-to-end Latency", "E2EL")}


def format_table(row: dict) -> str:
    lines = [f"{' Serving Benchmark Result ':=^50}", _line("Label:", row["label"]),
             _line("Request rate (req/s):", row["request_rate"]),
             _line("Burstiness:", row["burstiness"]),
             _line("Max concurrency:", row["max_concurrency"] or "unbounded"),
             _line("Successful requests:", row["completed"]),
             _line("Failed requests:", row["failed"]),
             _line("Benchmark duration (s):", row["duration"]),
             _line("Total input tokens:", row["total_input_tokens"]),
             _line("Total cached prompt tokens:", row["total_cached_tokens"]),
             _line("Total generated tokens:", row["total_output_tokens"]),
             _line("Request throughput (req/s):", row["request_throughput"])]
    if row["request_goodput"] is not None:
        lines.append(_line("Request goodput (req/s):", row["request_goodput"]))
    lines += [_line("Output token throughput (tok/s):", row["output_throughput"]),
              _line("Total Token throughput (tok/s):", row["total_token_throughput"]),
              _line("Concurrency (mean in flight):", row["concurrency"]),
              _line("Max concurrent requests:", row["max_concurrent_requests"])]
    for metric, (title, short) in LATENCY_TITLES.items():
        lines.append(_section(title))
        lines.append(_line(f"Mean {short} (ms):", row[f"mean_{metric}_ms"]))
        lines.append(_line(f"Median {short} (ms):", row[f"median_{metric}_ms"]))
        for p in row.get("percentiles") or ():
            if p == 50:  # the median line above already says it
                continue
            key = percentile_key(p)
            lines.append(_line(f"{key.upper()} {short} (ms):", row[f"{key}_{metric}_ms"]))
    lines += error_lines(row.get("errors") or [])
    lines.append("=" * 50)
    return "\n".join(lines)


def error_lines(errors: Iterable[str], top: int = 5) -> list[str]:
    counts = Counter(e for e in errors if e)
    if not counts:
        return []
    out = [_section("Errors")]
    out += [f"{n:>6} x {msg[:80]}" for msg, n in counts.most_common(top)]
    return out


# ---- the multi-run table (sweeps and `bench compare`) -------------------------------------

RUN_COLUMNS = (("label", 18), ("rate", 7), ("ok", 5), ("fail", 5), ("req/s", 8),
               ("out tok/s", 10), ("goodput", 8), ("TTFT p50", 9), ("TTFT p99", 9),
               ("TPOT p50", 9), ("TPOT p99", 9), ("ITL p50", 8), ("E2EL p99", 9))


def _cell(value: object, width: int) -> str:
    if value is None:
        text = "-"
    elif isinstance(value, str):
        return f"{value[:width]:<{width}}"  # labels read left to right
    elif isinstance(value, float):
        text = "inf" if math.isinf(value) else f"{value:.2f}"
    else:
        text = str(value)
    return f"{text[:width]:>{width}}"


def run_cells(row: dict) -> list[object]:
    return [row.get("label", ""), rate_of(row), row.get("completed"), row.get("failed"),
            row.get("request_throughput"), row.get("output_throughput"),
            row.get("request_goodput"), row_stat(row, "ttft", None), row_stat(row, "ttft", 99),
            row_stat(row, "tpot", None), row_stat(row, "tpot", 99), row_stat(row, "itl", None),
            row_stat(row, "e2el", 99)]


def format_runs(rows: list[dict]) -> str:
    """One line per run; latencies in ms."""
    header = " ".join(f"{name:<{w}}" if i == 0 else f"{name:>{w}}"
                      for i, (name, w) in enumerate(RUN_COLUMNS))
    body = [" ".join(_cell(v, w) for v, (_, w) in zip(run_cells(r), RUN_COLUMNS, strict=True))
            for r in rows]
    return "\n".join([header, "-" * len(header), *body])
