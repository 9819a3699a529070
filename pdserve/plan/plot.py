"""`--plot`: SLO attainment against request rate for the best shapes (DistServe's figure)."""

from __future__ import annotations

from pathlib import Path


def attainment_plot(path: str | Path, curves: dict[str, list[tuple[float, float]]],
                    rate: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, pts in curves.items():
        ax.plot([r for r, _ in pts], [100 * a for _, a in pts], marker="o", label=label)
    ax.axvline(rate, color="grey", linestyle=":", label=f"planned rate {rate:.3g}/s")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
