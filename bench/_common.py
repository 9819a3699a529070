"""Shared helpers of the benchmark scripts: a printed table and a JSON file with `summary`."""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from pdserve.cpus import cpu_description


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small run that finishes in ~1 minute")
    p.add_argument("--out", default="", help="write results as JSON to this path")
    return p


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return "" if v is None else str(v)


def write_json(path: str, summary: dict, rows: list[dict], args: argparse.Namespace) -> None:
    if not path:
        return
    doc = {
        "summary": summary,
        "rows": rows,
        "args": vars(args),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"python": platform.python_version(), "cpu": cpu_description(),
                    "arch": platform.machine()},
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2))
    print(f"wrote {path}")
