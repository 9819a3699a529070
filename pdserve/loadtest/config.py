"""The frozen configuration of one `pdserve bench` invocation, built once from the CLI.

Every field is one flag (`--random-input-len` -> `random_input_len`). Validation lives
here so a bad flag fails before any request is sent, with a message naming the flag.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from urllib.parse import urlparse

from pdserve.flags import ConfigError

BACKENDS = ("generate", "openai", "openai-chat")
DATASETS = ("random", "sharegpt", "shared-prefix")
SLO_KEYS = ("ttft", "tpot", "e2el")
# Default endpoint per backend; `--endpoint` overrides it (same as vLLM's flag).
ENDPOINTS = {
    "generate": "/generate",
    "openai": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:30000"
    backend: str = "generate"
    endpoint: str = ""  # empty: ENDPOINTS[backend]
    model: str = ""  # empty: the first id from GET /v1/models
    tokenizer: str = ""  # empty: try the served model name (a built-in or a local folder)
    dataset_name: str = "random"
    dataset_path: str = ""
    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    sharegpt_output_len: int = 0  # 0: the length of the reference completion
    gsp_num_groups: int = 64
    gsp_system_prompt_len: int = 2048
    gsp_question_len: int = 128
    gsp_output_len: int = 256
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int = 0  # 0: unbounded
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    json_schema: str = ""  # a JSON schema file every request's output must follow
    warmup_requests: int = 1
    goodput: dict[str, float] = field(default_factory=dict)  # SLO name -> milliseconds
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    output_file: str = ""
    label: str = ""  # empty: the backend name
    plot: str = ""
    sweep_rates: tuple[float, ...] = ()
    request_timeout: float = 600.0
    save_detailed: bool = False
    disable_tqdm: bool = False

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

    def as_record(self) -> dict:
        """The run's arguments as JSON-safe values (inf becomes "inf", as vLLM writes it)."""
        out = {}
        for key, value in asdict(self).items():
            if isinstance(value, float) and math.isinf(value):
                value = "inf"
            elif isinstance(value, tuple):
                value = ["inf" if math.isinf(v) else v for v in value]
            out[key] = value
        return out

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchConfig:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in names and v is not None}
        values["goodput"] = parse_goodput(args.goodput or [])
        values["percentiles"] = parse_percentiles(args.percentiles)
        values["sweep_rates"] = parse_rates(args.sweep_rates or "")
        values["request_rate"] = parse_rate(str(args.request_rate), "--request-rate")
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
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
        if self.request_timeout <= 0:
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
        if self.burstiness <= 0:
            raise ConfigError(f"--burstiness must be > 0 (got {self.burstiness})")
        if self.max_concurrency < 0:
            raise ConfigError("--max-concurrency must be >= 1 (or 0 for unbounded)")
        if self.warmup_requests < 0:
            raise ConfigError("--warmup-requests must be >= 0")
        if self.temperature < 0:
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
        if self.plot and not self.plot.lower().endswith(".png"):
            raise ConfigError(f"--plot {self.plot!r}: expected a FILE.png path")


def parse_rate(text: str, flag: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected a number of requests/s or 'inf'") from None
    if not rate > 0:  # also rejects nan
        raise ConfigError(f"{flag} must be > 0 (got {text})")
    return rate


def parse_rates(text: str) -> tuple[float, ...]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    return tuple(parse_rate(p, "--sweep-rates") for p in parts)


def parse_percentiles(text: str | None) -> tuple[float, ...]:
    if not text:
        return BenchConfig.percentiles
    out = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise ConfigError(f"--percentiles {text!r}: expected numbers like 50,90,99") from None
        if not 0 < value <= 100:
            raise ConfigError(f"--percentiles: {part} is not in (0, 100]")
        out.append(value)
    return tuple(out)


def parse_goodput(items: list[str]) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ConfigError(f"--goodput {item!r}: expected NAME:MS with NAME in "
                              f"{', '.join(SLO_KEYS)}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ConfigError(f"--goodput {item!r}: {value!r} is not a number") from None
        if slos[key] <= 0:
            raise ConfigError(f"--goodput {item!r}: the SLO must be > 0 ms")
    return slos
