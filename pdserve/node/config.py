"""Node server configuration: one frozen dataclass built once from the CLI.

Each field carries its flag's help text (`pdserve.flags.opt`); the engine's knobs are
`EngineConfig`, the HTTP bounds `HttpLimits`, a PD node's registry and KV transfer
`PDConfig`: each a sub-config with its own group of flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from pdserve.config import EngineConfig
from pdserve.flags import ConfigError, add_dataclass_flags, opt, values_from
from pdserve.http.limits import HttpLimits
from pdserve.http.tools import PARSERS
from pdserve.models.tokenizer import read_chat_template
from pdserve.pd.config import WILDCARDS, PDConfig
from pdserve.ports import check_port_file
from pdserve.tracing import ENDPOINT_HELP, endpoint_problem

LOG_LEVELS = ("debug", "info", "warning", "error")
SUB_CONFIGS = ("engine", "http", "role", "pd")  # not flags of the server group


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    http: HttpLimits = field(default_factory=HttpLimits)
    host: str = opt("127.0.0.1", "address to bind")
    port: int = opt(30000, "HTTP port (0: a free one the OS picks; the node logs it and "
                           "advertises it in its registry record)")
    port_file: str | None = opt(None, "once the node serves, write its HTTP port (decimal "
                                      "and a newline) to this file, atomically: how a parent "
                                      "that started it with --port 0 learns the port",
                                metavar="PATH")
    served_model_name: str = opt("", "model name clients use (default: the --model value)")
    max_queued_requests: int = opt(256, "waiting-queue bound; beyond it requests get HTTP 429")
    request_timeout_s: float = opt(600.0, "time limit of one request; beyond it HTTP 408")
    truncate_max_tokens: bool = opt(False, "when prompt + max_tokens exceed the model's "
                                           "context, clip max_tokens to what is left instead "
                                           "of answering HTTP 400")
    max_n: int = opt(16, "largest `n` (choices per OpenAI request); beyond it HTTP 400")
    watchdog_timeout_s: float = opt(300.0, "a scheduler loop iteration with no progress for "
                                           "this long (a hung forward or device) dumps every "
                                           "thread's stack and exits, so /livez fails and the "
                                           "node is restarted (0: off)")
    log_level: str = opt("info", "log level", choices=LOG_LEVELS)
    chat_template: str = opt("", "Jinja chat template file used instead of the model's (a "
                                 "router in front needs the same one)")
    tool_call_parser: str = opt("auto", "how chat answers are read for tool calls: the chat "
                                        "template's family (auto), hermes or llama3_json",
                                choices=PARSERS)
    otlp_traces_endpoint: str = opt("", ENDPOINT_HELP, metavar="URL")
    role: str = "colocated"  # colocated | prefill | decode (the subcommand)
    pd: PDConfig | None = None  # registry and KV transfer, for prefill/decode nodes

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        check_port_file(self.port_file)
        if self.max_queued_requests < 1 or self.request_timeout_s <= 0:
            raise ConfigError("--max-queued-requests and --request-timeout-s must be positive")
        if why := endpoint_problem(self.otlp_traces_endpoint):
            raise ConfigError(f"--otlp-traces-endpoint {self.otlp_traces_endpoint!r}: {why}")
        if self.max_n < 1:
            raise ConfigError(f"--max-n must be >= 1, got {self.max_n}")
        if self.watchdog_timeout_s < 0:
            raise ConfigError(f"--watchdog-timeout-s must be >= 0, got "
                              f"{self.watchdog_timeout_s}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
        if self.tool_call_parser not in PARSERS:
            raise ConfigError(f"--tool-call-parser must be one of {', '.join(PARSERS)}")
        if self.pd is not None and not self.pd.advertise_host and self.host in WILDCARDS:
            raise ConfigError(f"--host {self.host} is no address others can reach: "
                              "add --advertise-host (e.g. the pod IP)")
        if self.chat_template:
            read_chat_template(self.chat_template)  # a bad file fails here, not per request

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        add_dataclass_flags(p, ServerConfig, "server", skip=SUB_CONFIGS)
        add_dataclass_flags(p, HttpLimits, "HTTP limits")
        EngineConfig.add_cli_args(p)

    @classmethod
    def from_cli(cls, args: argparse.Namespace, role: str = "colocated") -> ServerConfig:
        return cls(engine=EngineConfig.from_cli(args),
                   http=HttpLimits(**values_from(HttpLimits, args)), role=role,
                   pd=PDConfig.from_cli(args) if role != "colocated" else None,
                   **values_from(cls, args, skip=SUB_CONFIGS))
