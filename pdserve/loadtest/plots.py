"""PNG plots from JSONL records: TTFT vs TPOT across rates, and TTFT/TPOT CDFs.

`F.png` gets the TTFT-vs-TPOT chart (one curve per label, one point per request rate,
median solid and p99 dashed) and `F_cdf.png` the CDFs (one curve per run). matplotlib is
imported lazily with the Agg backend: the bench never needs a display.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pdserve.loadtest.report import rate_of, row_stat


def cdf_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(f"{path.stem}_cdf{path.suffix}")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def by_label(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows grouped by label (first-seen order), each group sorted by request rate."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(str(row.get("label", "")), []).append(row)
    return {k: sorted(v, key=rate_of) for k, v in groups.items()}


def _rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def plot_ttft_vs_tpot(rows: list[dict], path: str | Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    for i, (label, group) in enumerate(by_label(rows).items()):
        color = f"C{i % 10}"
        for p, style, name in ((None, "-o", "p50"), (99, "--x", "p99")):
            pts = [(row_stat(r, "tpot", p), row_stat(r, "ttft", p), rate_of(r)) for r in group]
            pts = [t for t in pts if t[0] is not None and t[1] is not None]
            if not pts:
                continue
            ax.plot([t[0] for t in pts], [t[1] for t in pts], style, color=color,
                    label=f"{label} {name}")
            if p is None:  # name each median point by its request rate
                for x, y, rate in pts:
                    ax.annotate(_rate_text(rate), (x, y), textcoords="offset points",
                                xytext=(4, 4), fontsize=8, color=color)
    ax.set_xlabel("TPOT (ms)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT vs TPOT across request rates (req/s at points)")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    return _save(fig, plt, Path(path))


def _cdf(ax, values_s: list, label: str) -> None:
    values = np.sort(np.asarray([v for v in values_s if v is not None], dtype=float)) * 1000.0
    if values.size:
        ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=label)


def plot_cdfs(rows: list[dict], path: str | Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for label, group in by_label(rows).items():
        for row in group:
            name = f"{label} @ {_rate_text(rate_of(row))} req/s"
            _cdf(axes[0], row.get("ttfts") or [], name)
            _cdf(axes[1], row.get("tpots") or [], name)
    for ax, metric in zip(axes, ("TTFT", "TPOT"), strict=True):
        ax.set_xlabel(f"{metric} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"CDF of {metric}")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    return _save(fig, plt, cdf_path(path))


def _save(fig, plt, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(rows: list[dict], path: str | Path) -> list[Path]:
    return [plot_ttft_vs_tpot(rows, path), plot_cdfs(rows, path)]
