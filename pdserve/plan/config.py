"""Frozen configs of `pdserve profile` and `pdserve plan`, validated before any work."""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass

from kv_transfer.config import Backend
from pdserve.config import EngineConfig
from pdserve.flags import ConfigError, opt


@dataclass(frozen=True)
class ProfileConfig:
    engine: EngineConfig
    out: str = opt("profile.json", "profile JSON to write")
    quick: bool = opt(False, "fewer points (~1 min, tiny-llama)")
    transfer_backend: Backend = opt("tcp", "KV transfer backend measured between two "
                                           "processes", choices=("tcp", "mooncake"))
    skip_serving: bool = opt(False, "do not start a `pdserve serve` node to measure the HTTP "
                                    "and per-step serving overheads (they are then 0)")

    def __post_init__(self) -> None:
        if self.transfer_backend not in ("tcp", "mooncake"):
            raise ConfigError("--transfer-backend must be tcp or mooncake")
        if not self.out:
            raise ConfigError("--out is required")


@dataclass(frozen=True)
class PlanConfig:
    profile: str = opt(MISSING, "profile JSON written by `pdserve profile`", required=True)
    slo: tuple[str, ...] = opt(MISSING, "SLOs in ms, e.g. ttft_p90:500 tpot_p90:50 (keys: "
                                        "ttft|tpot|e2e _pNN or _mean)", required=True, nargs="+")
    rate: float = opt(0.0, "request rate (req/s); with --trace, rescale the trace to it (0: as "
                           "recorded)")
    trace: str = opt("", "trace JSONL: `pdserve bench` output, or Mooncake-style lines with "
                         "timestamp (ms), input_length, output_length (CSV with that header "
                         "works)")
    isl: str = opt("512", "prompt lengths: N, uniform:LO:HI, normal:MEAN:STD or "
                          "lognormal:MEAN:SIGMA")
    osl: str = opt("128", "output lengths, same forms as --isl")
    burstiness: float = opt(1.0, "gamma arrivals: 1 = Poisson, < 1 burstier")
    num_requests: int = opt(2000, "requests simulated per shape (synthetic workloads)")
    max_nodes: int = opt(8, "largest cluster searched (nodes of all kinds)")
    node_cost: tuple[str, ...] = opt((), "cost per node kind, e.g. prefill:2 decode:1 colocated:2 "
                                         "(default 1 each)", nargs="+")
    model: str = opt("", "refuse a profile of another model")
    page_size: int = opt(0, "refuse a profile measured with another page size (0: any)")
    machine_cores: float = opt(0.0, "model every node sharing one machine of this many cores (0: "
                                    "a machine per node)")
    node_threads: int = opt(0, "torch threads per node for --machine-cores (0: the profile's)")
    background_load: float = opt(0.0, "with --machine-cores: runnable threads of other processes "
                                      "on that machine (e.g. its load average before the stack "
                                      "starts)")
    transfer_backend: str = opt("", "transfer.backend in --values-out (default: the profile's)")
    values_out: str = opt("", "write Helm values for helm/pdserve (the best xPyD shape)")
    plot: str = opt("", "PNG of SLO attainment vs rate for the best shapes")
    out: str = opt("", "write the ranked shapes and the verdict as JSON (top-level `summary`)")
    top: int = opt(10, "rows of the printed table")
    seed: int = opt(0, "seed of arrivals, lengths and router ties")
    sim_workers: int = opt(0, "processes of the fast simulator (long PD workloads; 0: one per "
                              "core)")

    def __post_init__(self) -> None:
        if self.trace and self.rate < 0 or not self.trace and not self.rate > 0:
            raise ConfigError(f"--rate must be > 0 (got {self.rate}), or give --trace")
        if not math.isfinite(self.rate):
            raise ConfigError("--rate must be finite")
        if self.num_requests < 1 or self.max_nodes < 1 or self.top < 1:
            raise ConfigError("--num-requests, --max-nodes and --top must be >= 1")
        if self.burstiness <= 0 or min(self.machine_cores, self.node_threads,
                                       self.background_load) < 0:
            raise ConfigError("--burstiness must be > 0; --machine-cores, --node-threads, "
                              "--background-load >= 0")
        if self.page_size < 0 or self.sim_workers < 0:
            raise ConfigError("--page-size and --sim-workers must be >= 0")
        if self.transfer_backend not in ("", "tcp", "mooncake"):
            raise ConfigError("--transfer-backend must be tcp or mooncake")
        self.costs()

    def costs(self) -> dict[str, float]:
        """`--node-cost prefill:2 decode:1 colocated:2` (each kind defaults to 1)."""
        out = {"prefill": 1.0, "decode": 1.0, "colocated": 1.0}
        for item in self.node_cost:
            kind, _, value = item.partition(":")
            if kind not in out:
                raise ConfigError(f"--node-cost {item!r}: kind must be prefill, decode or "
                                 "colocated (e.g. prefill:2)")
            try:
                out[kind] = float(value)
            except ValueError:
                raise ConfigError(f"--node-cost {item!r}: cost must be a number") from None
            if not out[kind] > 0 or not math.isfinite(out[kind]):
                raise ConfigError(f"--node-cost {item!r}: cost must be > 0")
        return out
