"""`RouterConfig`: every knob of `pdserve router`, one `--flag` each, frozen, built once.

Each field carries its help text in `metadata`, so the flag list and the dataclass cannot
drift apart: `add_cli_args` walks the fields, `from_cli` reads them back.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from pdserve.flags import ConfigError, add_dataclass_flags, opt, values_from
from pdserve.http.limits import HttpLimits
from pdserve.http.tools import PARSERS
from pdserve.models.tokenizer import read_chat_template
from pdserve.ports import check_port_file
from pdserve.tokens import read_token_file
from pdserve.tracing import ENDPOINT_HELP, endpoint_problem

LOG_LEVELS = ("debug", "info", "warning", "error")


_opt = opt  # short name for the field list below


@dataclass(frozen=True)
class RouterConfig:
    registry: str = _opt("http://127.0.0.1:8998", "URL of the bootstrap registry")
    registry_token: str = _opt("", "bearer token for the registry (when it guards reads)")
    registry_token_file: str = _opt("", "read --registry-token from this file (a mounted "
                                        "Secret: the token stays out of the process list)")
    host: str = _opt("127.0.0.1", "address to bind")
    port: int = _opt(8000, "HTTP port (0: a free one the OS picks; the router logs it)")
    port_file: str | None = _opt(None, "once the router serves, write its HTTP port (decimal "
                                       "and a newline) to this file, atomically: how a "
                                       "parent that started it with --port 0 learns the port",
                                 metavar="PATH")
    model: str = _opt("", "model served (built-in name, local HF folder or Hub id ORG/NAME); "
                          "empty: the model the first registered node serves. Nodes serving "
                          "another are ignored")
    served_model_name: str = _opt("", "model name clients use (empty: the model)")
    model_cache_dir: str = _opt("", "where built-in models live (default: user cache)")
    revision: str = _opt("", "Hub models: the revision whose tokenizer to load (the nodes' "
                             "--revision; empty: main)")
    registry_poll_s: float = _opt(1.0, "seconds between reads of the registry's node list")
    max_running_requests: int = _opt(512, "requests dispatched to nodes at once")
    max_queued_requests: int = _opt(1024, "requests waiting for a dispatch slot; beyond: 429")
    queue_timeout_s: float = _opt(30.0, "longest wait for a dispatch slot; beyond: 408")
    request_timeout_s: float = _opt(600.0, "time limit of one whole request; beyond: 408")
    connect_timeout_s: float = _opt(5.0, "TCP connect limit towards a node")
    dispatch_attempts: int = _opt(3, "node pairs tried when a node cannot be reached or "
                                     "refuses before any output (429/503)")
    migration_limit: int = _opt(3, "times one request may move to a new node pair when its "
                                   "decode node dies mid-stream (0: end the stream with an "
                                   "error instead)")
    stream_stall_timeout_s: float = _opt(20.0, "a decode stream that sends nothing for this "
                                               "many seconds once it has begun is taken for a "
                                               "dead decode node (paused, hung) and migrated "
                                               "like one; so is one with no first event this "
                                               "long after the prefill node sent the KV "
                                               "(retried on another pair) (0: off; the request "
                                               "timeout still bounds it)")
    breaker_failures: int = _opt(3, "consecutive failures that open a node's circuit breaker "
                                    "(a refused connection opens it at once)")
    breaker_cooldown_s: float = _opt(2.0, "first pause of an open breaker before one trial "
                                          "request; doubles on each failed trial")
    breaker_max_cooldown_s: float = _opt(30.0, "longest pause of an open breaker")
    prefix_pages: int = _opt(2, "leading prompt pages hashed for prefill affinity (0: off)")
    balance_abs_threshold: int = _opt(4, "prefix affinity yields to the least-loaded prefill "
                                         "node when the preferred one has this many more "
                                         "requests ...")
    balance_rel_threshold: float = _opt(1.5, "... and more than this factor of its load")
    truncate_max_tokens: bool = _opt(False, "when prompt + max_tokens exceed the model's "
                                            "context, clip max_tokens to what is left "
                                            "instead of answering 400")
    max_n: int = _opt(16, "largest `n` (choices per OpenAI request); beyond: 400")
    drain_timeout_s: float = _opt(30.0, "on SIGTERM: let open requests and streams finish "
                                        "for up to this long, then cancel the rest (the "
                                        "chart's grace period follows it)")
    log_level: str = _opt("info", "log level", choices=LOG_LEVELS)
    chat_template: str = _opt("", "Jinja chat template file used instead of the model's "
                                  "(give the nodes the same one)")
    tool_call_parser: str = _opt("auto", "how chat answers are read for tool calls: the "
                                         "chat template's family (auto), hermes or "
                                         "llama3_json", choices=PARSERS)
    otlp_traces_endpoint: str = _opt("", ENDPOINT_HELP, metavar="URL")
    http: HttpLimits = field(default_factory=HttpLimits)  # its own flag group

    def __post_init__(self) -> None:
        if why := endpoint_problem(self.otlp_traces_endpoint):
            raise ConfigError(f"--otlp-traces-endpoint {self.otlp_traces_endpoint!r}: {why}")
        url = urlsplit(self.registry)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ConfigError(f"--registry {self.registry!r}: expected http://HOST:PORT")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        check_port_file(self.port_file)
        positive = {"--registry-poll-s": self.registry_poll_s,
                    "--max-running-requests": self.max_running_requests,
                    "--queue-timeout-s": self.queue_timeout_s,
                    "--request-timeout-s": self.request_timeout_s,
                    "--connect-timeout-s": self.connect_timeout_s,
                    "--dispatch-attempts": self.dispatch_attempts,
                    "--breaker-failures": self.breaker_failures,
                    "--breaker-cooldown-s": self.breaker_cooldown_s,
                    "--max-n": self.max_n}
        for flag, value in positive.items():
            if not value > 0:
                raise ConfigError(f"{flag} must be > 0, got {value}")
        if min(self.max_queued_requests, self.prefix_pages, self.migration_limit,
               self.stream_stall_timeout_s, self.drain_timeout_s) < 0:
            raise ConfigError("--max-queued-requests, --prefix-pages, --migration-limit, "
                             "--stream-stall-timeout-s and --drain-timeout-s must be >= 0")
        if self.breaker_max_cooldown_s < self.breaker_cooldown_s:
            raise ConfigError("--breaker-max-cooldown-s must be >= --breaker-cooldown-s")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ConfigError("need --balance-abs-threshold >= 0 and --balance-rel-threshold >= 1")
        if self.tool_call_parser not in PARSERS:
            raise ConfigError(f"--tool-call-parser must be one of {', '.join(PARSERS)}")
        if self.chat_template:
            read_chat_template(self.chat_template)
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        add_dataclass_flags(p, RouterConfig, "router", skip=("http",))
        add_dataclass_flags(p, HttpLimits, "HTTP limits")

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> RouterConfig:
        values = values_from(cls, args, skip=("http",))
        values["http"] = HttpLimits(**values_from(HttpLimits, args))
        token = read_token_file(values["registry_token_file"], "--registry-token-file")
        if token is not None:
            values["registry_token"] = token
        return cls(**values)
