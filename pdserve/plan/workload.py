"""Planning workloads: arrival times plus prompt and output lengths per request.

Synthetic: gamma renewal arrivals at a rate (burstiness 1 = Poisson, the same process as
`pdserve bench`, `pdserve/loadtest/arrivals.py`) with lengths drawn from a distribution
spec. Traces, one JSON object per line:
- a `pdserve bench --output-file` JSONL: each run line's `input_lens` / `output_lens`
  (requests without a completion are skipped) placed at that run's `request_rate`;
- Mooncake style: `{"timestamp": ms, "input_length": n, "output_length": m}` per line
  (CSV with that header works too).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.loadtest.arrivals import arrival_times


@dataclass
class Workload:
    arrival: np.ndarray  # seconds from the start, non-decreasing
    isl: np.ndarray  # prompt tokens (int64, >= 1)
    osl: np.ndarray  # output tokens (int64, >= 1)

    def __len__(self) -> int:
        return len(self.arrival)

    @property
    def rate(self) -> float:
        span = float(self.arrival[-1] - self.arrival[0]) if len(self) > 1 else 0.0
        return (len(self) - 1) / span if span > 0 else math.inf

    def scaled(self, rate: float) -> Workload:
        """The same requests with arrival times stretched to a mean rate of `rate`."""
        factor = self.rate / rate if math.isfinite(self.rate) else 1.0
        return Workload(self.arrival * factor, self.isl, self.osl)


def parse_dist(spec: str) -> tuple[str, tuple[float, ...]]:
    """`N` (fixed), `uniform:LO:HI`, `normal:MEAN:STD`, `lognormal:MEAN:SIGMA`."""
    parts = str(spec).split(":")
    try:
        nums = tuple(float(x) for x in (parts if len(parts) == 1 else parts[1:]))
    except ValueError:
        raise ValueError(f"bad length distribution {spec!r}: numbers expected") from None
    kind = "fixed" if len(parts) == 1 else parts[0]
    want = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2}
    if kind not in want or len(nums) != want[kind]:
        raise ValueError(f"bad length distribution {spec!r}: use N, uniform:LO:HI, "
                         "normal:MEAN:STD or lognormal:MEAN:SIGMA")
    if nums[0] < 1 or any(v < 0 for v in nums) or (kind == "uniform" and nums[1] < nums[0]):
        raise ValueError(f"bad length distribution {spec!r}: lengths must be >= 1")
    return kind, nums


def draw_lengths(spec: str, n: int, rng: np.random.Generator) -> np.ndarray:
    kind, a = parse_dist(spec)
    if kind == "fixed":
        x = np.full(n, a[0])
    elif kind == "uniform":
        x = rng.uniform(a[0], a[1] + 1, n)
    elif kind == "normal":
        x = rng.normal(a[0], a[1], n)
    else:  # lognormal with the given mean
        x = rng.lognormal(math.log(a[0]) - a[1] ** 2 / 2, a[1], n)
    return np.maximum(1, np.floor(x)).astype(np.int64)


def synthetic(rate: float, n: int, isl: str, osl: str, burstiness: float = 1.0,
              seed: int = 0) -> Workload:
    if not rate > 0 or not math.isfinite(rate):
        raise ValueError(f"--rate must be a positive number, got {rate}")
    if burstiness <= 0:
        raise ValueError("--burstiness must be > 0")
    if n < 1:
        raise ValueError("need at least one request")
    rng = np.random.default_rng([seed, 2])
    return Workload(arrival_times(n, rate, burstiness, seed), draw_lengths(isl, n, rng),
                    draw_lengths(osl, n, rng))


def load_trace(path: str | Path) -> Workload:
    """A bench JSONL or a Mooncake-style trace (JSONL or CSV); ValueError names the problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read trace {path}: {exc.strerror}") from None
    first = text.lstrip()[:1]
    rows = _csv_rows(text, path) if first and first not in "{[" else _json_rows(text, path)
    if not rows:
        raise ValueError(f"trace {path} has no requests")
    if "input_lens" in rows[0]:
        return _from_bench(rows, path)
    return _from_mooncake(rows, path)


def _json_rows(text: str, path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not a JSON line ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object")
            rows.append(row)
    return rows


def _csv_rows(text: str, path: Path) -> list[dict]:
    reader = csv.DictReader(text.splitlines())
    need = {"timestamp", "input_length", "output_length"}
    if not need <= set(reader.fieldnames or ()):
        raise ValueError(f"{path}: neither JSON lines nor a CSV with the header "
                         "timestamp,input_length,output_length")
    return [dict(r) for r in reader]


def _from_mooncake(rows: list[dict], path: Path) -> Workload:
    need = ("timestamp", "input_length", "output_length")
    ts, isl, osl = [], [], []
    for n, row in enumerate(rows, 1):
        missing = [k for k in need if row.get(k) in (None, "")]
        if missing:
            raise ValueError(f"{path}: request {n} lacks {', '.join(missing)} (a trace needs "
                             "timestamp, input_length, output_length; or a pdserve bench "
                             "JSONL)")
        try:
            ts.append(float(row["timestamp"]) / 1000.0)
            isl.append(int(row["input_length"]))
            osl.append(int(row["output_length"]))
        except (TypeError, ValueError):
            raise ValueError(f"{path}: request {n}: fields must be numbers") from None
    arr = np.asarray(ts)
    if (np.diff(arr) < 0).any():
        order = np.argsort(arr, kind="stable")
        arr, isl, osl = arr[order], list(np.asarray(isl)[order]), list(np.asarray(osl)[order])
    return _checked(arr - arr[0], isl, osl, path)


def _from_bench(rows: list[dict], path: Path) -> Workload:
    arrivals, isl, osl, t0 = [], [], [], 0.0
    for n, row in enumerate(rows, 1):
        ins, outs = row.get("input_lens"), row.get("output_lens")
        if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
            raise ValueError(f"{path}:{n}: a bench line needs input_lens and output_lens")
        keep = [(i, o) for i, o in zip(ins, outs, strict=True) if o]
        rate = row.get("request_rate")
        rate = float(rate) if rate not in (None, "inf") else math.inf
        gaps = np.zeros(len(keep)) if math.isinf(rate) else np.full(len(keep), 1.0 / rate)
        arrivals.extend((t0 + np.cumsum(gaps)).tolist())
        t0 = arrivals[-1] if arrivals else t0
        isl += [i for i, _ in keep]
        osl += [o for _, o in keep]
    return _checked(np.asarray(arrivals), isl, osl, path)


def _checked(arr: np.ndarray, isl: list, osl: list, path: Path) -> Workload:
    if len(arr) == 0:
        raise ValueError(f"trace {path} has no completed requests")
    isl_a, osl_a = np.asarray(isl, dtype=np.int64), np.asarray(osl, dtype=np.int64)
    if (isl_a < 1).any() or (osl_a < 1).any():
        raise ValueError(f"trace {path}: input and output lengths must be >= 1")
    return Workload(arr.astype(np.float64), isl_a, osl_a)
