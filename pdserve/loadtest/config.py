"""The frozen configuration of one `pdserve bench` invocation, built once from the CLI.

Every field is one flag (`--random-input-len` -> `random_input_len`, pdserve/flags.py):
its default and help text live in the field, its checks in `__post_init__`, so a bad flag
fails before any request is sent, with a message naming the flag.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from urllib.parse import urlparse

from pdserve.flags import ConfigError, add_dataclass_flags, comma_list, opt, values_from

BACKENDS = ("generate", "openai", "openai-chat")
DATASETS = ("random", "sharegpt", "shared-prefix")
SLO_KEYS = ("ttft", "tpot", "e2el")
# Default endpoint per backend; `--endpoint` overrides it (same as vLLM's flag).
ENDPOINTS = {
    "generate": "/generate",
    "openai": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}
# `pdserve bench --help` sections; every field is in exactly one.
FLAG_GROUPS = {
    "target": ("base_url", "backend", "endpoint", "model", "tokenizer", "request_timeout"),
    "dataset": ("dataset_name", "dataset_path", "num_prompts", "random_input_len",
                "random_output_len", "random_range_ratio", "sharegpt_output_len",
                "gsp_num_groups", "gsp_system_prompt_len", "gsp_question_len",
                "gsp_output_len"),
    "load": ("request_rate", "burstiness", "max_concurrency", "sweep_rates", "seed",
             "warmup_requests", "ignore_eos", "temperature", "json_schema"),
    "results": ("goodput", "percentiles", "output_file", "label", "plot", "save_detailed",
                "disable_tqdm"),
    "trace breakdown": ("trace_breakdown", "trace_receiver_host", "trace_receiver_port",
                        "trace_wait_s"),
}


@dataclass(frozen=True)
class BenchConfig:
    # target
    base_url: str = opt("http://127.0.0.1:30000", "server to load (node or router)")
    backend: str = opt("generate", "generate: POST /generate (token ids); openai: "
                       "/v1/completions; openai-chat: /v1/chat/completions", choices=BACKENDS)
    endpoint: str = opt("", "override the backend's URL path")  # empty: ENDPOINTS[backend]
    model: str = opt("", "model name sent to OpenAI endpoints (default: first of /v1/models)")
    tokenizer: str = opt("", "local HF folder or built-in model name (default: the served "
                         "model when it is a local folder or a cached built-in)")
    request_timeout: float = opt(600.0, "seconds before one request counts as failed")
    # dataset
    dataset_name: str = opt("random", "random token ids, ShareGPT conversations, or "
                            "shared-prefix groups", choices=DATASETS)
    dataset_path: str = opt("", "ShareGPT-format JSON (a list of {conversations: [{from, "
                            "value}...]})")
    num_prompts: int = opt(1000, "requests per run (all datasets)")
    random_input_len: int = opt(1024, "random: mean prompt tokens")
    random_output_len: int = opt(128, "random: mean output tokens")
    random_range_ratio: float = opt(0.0, "lengths uniform in [L*(1-r), L*(1+r)] (as vLLM)")
    sharegpt_output_len: int = opt(0, "fixed output length for ShareGPT (0: the reference "
                                   "reply's length)")
    gsp_num_groups: int = opt(64, "shared-prefix: groups; prompt i joins group i %% groups")
    gsp_system_prompt_len: int = opt(2048, "shared-prefix: tokens of each group's shared "
                                     "prefix")
    gsp_question_len: int = opt(128, "shared-prefix: tokens of each prompt's own suffix")
    gsp_output_len: int = opt(256, "shared-prefix: output tokens per request")
    # load
    request_rate: float = opt(math.inf, "requests/s ('inf': all at once)")
    burstiness: float = opt(1.0, "gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier")
    max_concurrency: int = opt(0, "most requests in flight (0: unbounded)")
    sweep_rates: tuple[float, ...] = opt((), "comma-separated rates, one run each (overrides "
                                         "--request-rate)", type=comma_list(float))
    seed: int = opt(0, "seeds prompts and arrivals")
    warmup_requests: int = opt(1, "untimed requests sent before the runs")
    ignore_eos: bool = opt(True, "generate exactly the requested output length")
    temperature: float = opt(0.0, "0: greedy")
    json_schema: str = opt("", "constrain every output to this JSON schema (structured "
                           "output: response_format, or sampling_params.json_schema on "
                           "/generate)", metavar="FILE")
    # results
    goodput: tuple[str, ...] = opt((), "SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000",
                                   nargs="+", metavar="NAME:MS")
    percentiles: tuple[float, ...] = opt((50.0, 90.0, 99.0), "percentiles to report",
                                         type=comma_list(float))
    output_file: str = opt("", "append one JSON line per run to this file")
    label: str = opt("", "name of this configuration (default: the backend); plots draw one "
                     "curve per label")
    plot: str = opt("", "write F.png (TTFT vs TPOT over the runs) and F_cdf.png (CDFs)",
                    metavar="F.png")
    save_detailed: bool = opt(False, "also store per-request ITLs, start times and generated "
                              "texts")
    disable_tqdm: bool = opt(False, "no progress bar")
    # trace breakdown (docs/loadtest.md, docs/architecture.md: Tracing)
    trace_breakdown: bool = opt(False, "send a W3C traceparent with every request, receive "
                                "the servers' spans on an OTLP/HTTP receiver of our own, and "
                                "report p50/p99 of each hop (ms); start the servers with "
                                "--otlp-traces-endpoint http://HOST:PORT of "
                                "--trace-receiver-host/--trace-receiver-port")
    trace_receiver_host: str = opt("127.0.0.1", "address the trace receiver binds")
    trace_receiver_port: int = opt(4318, "port of the trace receiver (4318: OTLP/HTTP's own)")
    trace_wait_s: float = opt(10.0, "after a run, longest wait for the servers' spans")

    def __post_init__(self) -> None:
        self.validate()

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        """One argument group per FLAG_GROUPS entry, one flag per field."""
        names = [f.name for f in fields(BenchConfig)]
        for title, group in FLAG_GROUPS.items():
            add_dataclass_flags(p, BenchConfig, title,
                                skip=tuple(n for n in names if n not in group))

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> BenchConfig:
        return cls(**values_from(cls, args))

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + (self.endpoint or ENDPOINTS[self.backend])

    @property
    def run_label(self) -> str:
        return self.label or self.backend

    def rates(self) -> tuple[float, ...]:
        """The request rates to run: the sweep when given, else the single rate."""
        return self.sweep_rates or (self.request_rate,)

    def with_rate(self, rate: float) -> BenchConfig:
        return replace(self, request_rate=rate)

    def slos_ms(self) -> dict[str, float]:
        """`--goodput ttft:200 tpot:50` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
        slos: dict[str, float] = {}
        for item in self.goodput:
            key, sep, value = item.partition(":")
            if not sep or key not in SLO_KEYS:
                raise ConfigError(f"--goodput {item!r}: expected NAME:MS with NAME in "
                                  f"{', '.join(SLO_KEYS)}")
            try:
                slos[key] = float(value)
            except ValueError:
                raise ConfigError(f"--goodput {item!r}: {value!r} is not a number") from None
            if not 0 < slos[key] < math.inf:  # also rejects nan
                raise ConfigError(f"--goodput {item!r}: the SLO must be > 0 ms (and finite)")
        return slos

    def as_record(self) -> dict:
        """The run's arguments as JSON-safe values (inf becomes "inf", as vLLM writes it;
        goodput is the {NAME: ms} mapping)."""
        out: dict = {}
        for key, value in asdict(self).items():
            if key == "goodput":
                value = self.slos_ms()
            elif isinstance(value, float) and math.isinf(value):
                value = "inf"
            elif isinstance(value, tuple):
                value = ["inf" if math.isinf(v) else v for v in value]
            out[key] = value
        return out

    def validate(self) -> None:
        """The checks `__post_init__` runs (a config that exists has passed them)."""
        for check in (self._check_target, self._check_dataset, self._check_load,
                      self._check_outputs):
            check()

    def _check_target(self) -> None:
        url = urlparse(self.base_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ConfigError(f"--base-url {self.base_url!r}: expected http://HOST:PORT")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend {self.backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.endpoint and not self.endpoint.startswith("/"):
            raise ConfigError(f"--endpoint {self.endpoint!r}: must start with '/'")
        if not self.request_timeout > 0:
            raise ConfigError("--request-timeout must be > 0")

    def _check_dataset(self) -> None:
        if self.dataset_name not in DATASETS:
            raise ConfigError(f"--dataset-name {self.dataset_name!r}: choose one of "
                              f"{', '.join(DATASETS)}")
        if self.dataset_name == "sharegpt":
            if not self.dataset_path:
                raise ConfigError("--dataset-name sharegpt needs --dataset-path FILE.json")
            if not Path(self.dataset_path).is_file():
                raise ConfigError(f"--dataset-path {self.dataset_path!r}: no such file")
        positive = {
            "--num-prompts": self.num_prompts, "--random-input-len": self.random_input_len,
            "--random-output-len": self.random_output_len, "--gsp-num-groups": self.gsp_num_groups,
            "--gsp-system-prompt-len": self.gsp_system_prompt_len,
            "--gsp-question-len": self.gsp_question_len, "--gsp-output-len": self.gsp_output_len,
        }
        for flag, value in positive.items():
            if value < 1:
                raise ConfigError(f"{flag} must be >= 1 (got {value})")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ConfigError(f"--random-range-ratio must be in [0, 1) (got "
                              f"{self.random_range_ratio})")
        if self.sharegpt_output_len < 0:
            raise ConfigError("--sharegpt-output-len must be >= 0")

    def _check_load(self) -> None:
        if not self.request_rate > 0:  # also rejects nan
            raise ConfigError(f"--request-rate must be > 0 (got {self.request_rate:g})")
        for rate in self.sweep_rates:
            if not rate > 0:
                raise ConfigError(f"--sweep-rates: every rate must be > 0 (got {rate:g})")
        if not self.burstiness > 0:
            raise ConfigError(f"--burstiness must be > 0 (got {self.burstiness})")
        if self.max_concurrency < 0:
            raise ConfigError("--max-concurrency must be >= 1 (or 0 for unbounded)")
        if self.warmup_requests < 0:
            raise ConfigError("--warmup-requests must be >= 0")
        if not self.temperature >= 0:
            raise ConfigError("--temperature must be >= 0")
        if self.json_schema:
            self.schema_text()

    def schema_text(self) -> str | None:
        """The --json-schema file's schema as compact JSON text (None without one)."""
        if not self.json_schema:
            return None
        try:
            return json.dumps(json.loads(Path(self.json_schema).read_text()))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--json-schema {self.json_schema!r}: {exc}") from None

    def _check_outputs(self) -> None:
        self.slos_ms()
        if not self.percentiles:
            raise ConfigError("--percentiles: give at least one, e.g. 50,90,99")
        for p in self.percentiles:
            if not 0 < p <= 100:
                raise ConfigError(f"--percentiles: {p:g} is not in (0, 100]")
        if self.plot and not self.plot.lower().endswith(".png"):
            raise ConfigError(f"--plot {self.plot!r}: expected a FILE.png path")
        if not 0 <= self.trace_receiver_port < 65536:
            raise ConfigError(f"--trace-receiver-port must be in 0..65535, got "
                              f"{self.trace_receiver_port}")
        if not self.trace_wait_s > 0:
            raise ConfigError("--trace-wait-s must be > 0")
