"""Frozen configs of `pdserve profile` and `pdserve plan`, validated before any work."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.config import EngineConfig


@dataclass(frozen=True)
class ProfileConfig:
    engine: EngineConfig
    out: str = "profile.json"
    quick: bool = False
    transfer_backend: str = "tcp"

    def __post_init__(self) -> None:
        if self.transfer_backend not in ("tcp", "mooncake"):
            raise ValueError("--transfer-backend must be tcp or mooncake")
        if not self.out:
            raise ValueError("--out is required")


@dataclass(frozen=True)
class PlanConfig:
    profile: str
    slo: tuple[str, ...]
    rate: float = 0.0  # req/s; with --trace: rescale the trace to this rate (0: as recorded)
    trace: str = ""
    isl: str = "512"
    osl: str = "128"
    burstiness: float = 1.0
    num_requests: int = 2000
    max_nodes: int = 8
    node_cost: tuple[str, ...] = ()
    model: str = ""  # refuse a profile of another model (empty: any)
    page_size: int = 0  # refuse a profile of another page size (0: any)
    machine_cores: float = 0.0
    node_threads: int = 0  # 0: the profile's torch threads
    background_load: float = 0.0  # other runnable threads on the shared machine
    transfer_backend: str = ""  # values.yaml transfer.backend (empty: the profile's)
    values_out: str = ""
    plot: str = ""
    out: str = ""
    top: int = 10
    seed: int = 0
    sim_workers: int = 0  # processes of the fast simulator (0: one per core)

    def __post_init__(self) -> None:
        if self.trace and self.rate < 0 or not self.trace and not self.rate > 0:
            raise ValueError(f"--rate must be > 0 (got {self.rate}), or give --trace")
        if not math.isfinite(self.rate):
            raise ValueError("--rate must be finite")
        if self.num_requests < 1 or self.max_nodes < 1 or self.top < 1:
            raise ValueError("--num-requests, --max-nodes and --top must be >= 1")
        if self.burstiness <= 0 or min(self.machine_cores, self.node_threads,
                                       self.background_load) < 0:
            raise ValueError("--burstiness must be > 0; --machine-cores, --node-threads, "
                             "--background-load >= 0")
        if self.page_size < 0 or self.sim_workers < 0:
            raise ValueError("--page-size and --sim-workers must be >= 0")
        if self.transfer_backend not in ("", "tcp", "mooncake"):
            raise ValueError("--transfer-backend must be tcp or mooncake")
        self.costs()

    def costs(self) -> dict[str, float]:
        """`--node-cost prefill:2 decode:1 colocated:2` (each kind defaults to 1)."""
        out = {"prefill": 1.0, "decode": 1.0, "colocated": 1.0}
        for item in self.node_cost:
            kind, _, value = item.partition(":")
            if kind not in out:
                raise ValueError(f"--node-cost {item!r}: kind must be prefill, decode or "
                                 "colocated (e.g. prefill:2)")
            try:
                out[kind] = float(value)
            except ValueError:
                raise ValueError(f"--node-cost {item!r}: cost must be a number") from None
            if not out[kind] > 0 or not math.isfinite(out[kind]):
                raise ValueError(f"--node-cost {item!r}: cost must be > 0")
        return out
