"""Helm values for `helm/pdserve` from a plan: tier replicas and the node flags the
simulation assumed (every key exists in the chart's values.yaml; `check_keys` proves it)."""

from __future__ import annotations

from pathlib import Path

import yaml

from pdserve.plan.profile_model import Profile
from pdserve.plan.sim import ClusterSpec

CHART_VALUES = Path(__file__).resolve().parents[2] / "helm" / "pdserve" / "values.yaml"


def plan_values(prof: Profile, cluster: ClusterSpec, backend: str) -> dict:
    """Values of the PD tiers of `cluster` (a colocated plan has no chart: the caller says so)."""
    e = prof.engine_knobs()
    engine_args = ["--max-prefill-tokens", str(e["max_prefill_tokens"]),
                   "--decode-reserve-tokens", str(e["decode_reserve_tokens"])]
    return {
        "model": {"name": prof.model},
        "engine": {"pageSize": prof.page_size, "dtype": e["dtype"]},
        "transfer": {"backend": backend},
        "prefill": {"replicas": cluster.prefill,
                    "maxRunningRequests": int(e["max_running_requests"]),
                    "kvCacheMb": int(e["kv_cache_mb"]),
                    "chunkedPrefillSize": int(e["chunked_prefill_size"]),
                    "threads": prof.torch_threads,  # the forward threads it was profiled at
                    "extraArgs": engine_args},
        "decode": {"replicas": cluster.decode,
                   "maxRunningRequests": int(e["max_running_requests"]),
                   "kvCacheMb": int(e["kv_cache_mb"]),
                   "threads": prof.torch_threads,
                   "extraArgs": list(engine_args)},
    }


def check_keys(values: dict, chart_values: Path = CHART_VALUES) -> None:
    """Raise ValueError naming any key the chart's values.yaml does not have."""
    defaults = yaml.safe_load(chart_values.read_text())
    bad: list[str] = []

    def walk(ours: dict, theirs: dict, prefix: str) -> None:
        for key, value in ours.items():
            if not isinstance(theirs, dict) or key not in theirs:
                bad.append(prefix + key)
            elif isinstance(value, dict):
                walk(value, theirs[key], f"{prefix}{key}.")

    walk(values, defaults, "")
    if bad:
        raise ValueError(f"keys unknown to {chart_values}: {', '.join(bad)}")


def write_values(path: str | Path, values: dict, header: str) -> None:
    check_keys(values)
    text = "".join(f"# {line}\n" for line in header.splitlines())
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text + yaml.safe_dump(values, sort_keys=False))
