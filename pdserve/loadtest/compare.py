"""`pdserve bench compare A.jsonl B.jsonl ...`: runs side by side, ratios, one plot.

Each file may hold many runs (a sweep, repeats). Runs are grouped by label; a label found
in several files is prefixed with the file's stem so the groups stay apart. When there are
two or more labels, every label is also compared with the first one at the rates they share.
"""

from __future__ import annotations

import math
from pathlib import Path

from pdserve.loadtest.plots import by_label, cdf_path, write_plots
from pdserve.loadtest.report import format_runs, rate_of, read_jsonl, row_stat

RATIO_METRICS = (("TTFT p50", "ttft", None), ("TTFT p99", "ttft", 99),
                 ("TPOT p50", "tpot", None), ("TPOT p99", "tpot", 99))


def load_runs(paths: list[str]) -> list[dict]:
    per_file = {p: read_jsonl(p) for p in paths}
    owners: dict[str, set[str]] = {}
    for path, rows in per_file.items():
        for row in rows:
            owners.setdefault(str(row.get("label") or Path(path).stem), set()).add(path)
    runs = []
    for path, rows in per_file.items():
        for row in rows:
            label = str(row.get("label") or Path(path).stem)
            if len(owners[label]) > 1:
                label = f"{Path(path).stem}:{label}"
            runs.append({**row, "label": label})
    return runs


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or a == 0:
        return "-"
    return f"{b / a:.2f}x"


def format_ratios(runs: list[dict]) -> str:
    """Each label against the first, per shared rate (the latest run of each at that rate)."""
    groups = by_label(runs)
    if len(groups) < 2:
        return ""
    base_label, *others = groups
    base = {rate_of(r): r for r in groups[base_label]}
    lines = [f"ratios vs {base_label} (value / {base_label}):"]
    for label in others:
        for row in groups[label]:
            rate = rate_of(row)
            if rate not in base:
                continue
            cells = [f"{name} {_ratio(row_stat(base[rate], m, p), row_stat(row, m, p))}"
                     for name, m, p in RATIO_METRICS]
            rate_text = "inf" if math.isinf(rate) else f"{rate:g}"
            lines.append(f"  {label} @ {rate_text} req/s: " + ", ".join(cells))
    return "\n".join(lines) if len(lines) > 1 else ""


def run_compare(files: list[str], plot: str) -> int:
    try:
        runs = load_runs(files)
    except (OSError, ValueError) as exc:
        print(f"pdserve bench compare: error: {exc}")
        return 2
    if not runs:
        print("pdserve bench compare: error: no runs in " + ", ".join(files))
        return 2
    print(format_runs(runs))
    ratios = format_ratios(runs)
    if ratios:
        print("\n" + ratios)
    if plot:
        write_plots(runs, plot)
        print(f"\nplots: {plot}, {cdf_path(plot)}")
    return 0
