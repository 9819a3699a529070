"""Frozen configs of `pdserve up` (`StackConfig`) and `pdserve demo` (`DemoConfig`), one
`--flag` per field; the help text lives in each field's metadata."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, replace

from pdserve.config import HICACHE_STORAGE_BACKENDS
from pdserve.flags import ConfigError, add_dataclass_flags, opt, values_from
from pdserve.ports import check_port_file
from pdserve.tokens import read_token_file
from pdserve.tracing import ENDPOINT_HELP, endpoint_problem

TRANSFER_BACKENDS = ("", "mooncake", "tcp")


_opt = opt  # short name for the field lists below


@dataclass(frozen=True)
class StackConfig:
    model: str = _opt("", "model of every node: built-in name (smollm2-135m, tiny-llama, "
                          "tiny-qwen2), a local HF folder or a Hub id ORG/NAME")
    revision: str = _opt("", "Hub models: the branch, tag or commit every node and the "
                             "router load (empty: main)")
    load_format: str = _opt("auto", "the nodes' --load-format: auto (the checkpoint's "
                                    "weights) or dummy (random weights of its shape)",
                            choices=("auto", "dummy"))
    prefill: int = _opt(1, "prefill nodes")
    decode: int = _opt(1, "decode nodes")
    host: str = _opt("127.0.0.1", "address the router binds (the rest stay on loopback)")
    port: int = _opt(8000, "router port (0: any free port)")
    registry_port: int = _opt(0, "registry port (0: any free port)")
    port_file: str | None = _opt(None, "once the whole stack serves, write the router's port "
                                       "(decimal and a newline) to this file, atomically: "
                                       "how a parent that started it with --port 0 learns "
                                       "the port", metavar="PATH")
    transfer_backend: str = _opt("", "KV transfer backend of the nodes: mooncake or tcp "
                                     "(empty: mooncake where it loads, else tcp)",
                                 choices=TRANSFER_BACKENDS,
                                 metavar="{mooncake,tcp}")
    node_threads: int = _opt(0, "forward threads of each node (0: this machine's cores "
                                "split evenly between the nodes, at least 1; a --threads "
                                "in --node-args wins)")
    node_args: str = _opt("", "extra flags for every node, e.g. '--max-running-requests 32'")
    prefill_args: str = _opt("", "extra flags for prefill nodes only, after --node-args, "
                                 "e.g. '--enable-hierarchical-cache'")
    decode_args: str = _opt("", "extra flags for decode nodes only, after --node-args")
    router_args: str = _opt("", "extra flags for the router, e.g. '--queue-timeout-s 5'")
    hicache_storage_backend: str = _opt("", "give the prefill nodes HiCache with this "
                                            "storage tier, shared by them: file (a folder, "
                                            "--hicache-storage-path) or mooncake (up starts "
                                            "a mooncake_master); empty: none",
                                        choices=HICACHE_STORAGE_BACKENDS,
                                        metavar="{file,mooncake}")
    hicache_storage_path: str = _opt("", "folder of the file storage tier (default: "
                                         "kv-storage in the log folder)")
    registry_token: str = _opt("", "bearer token the registry requires for writes")
    registry_token_file: str = _opt("", "read --registry-token from this file (children "
                                        "get it as a file too, never in argv)")
    otlp_traces_endpoint: str = _opt("", ENDPOINT_HELP + "; given to the router and every "
                                     "node", metavar="URL")
    log_dir: str = _opt("", "folder for the children's logs (default: a new temp folder)")
    startup_timeout_s: float = _opt(900.0, "longest wait for every process to be healthy "
                                           "(the first start converts smollm2-135m)")
    stop_timeout_s: float = _opt(20.0, "grace for each child after SIGTERM before SIGKILL")

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("--model is required")
        if self.prefill < 1 or self.decode < 1:
            raise ConfigError("--prefill and --decode must be >= 1")
        check_port_file(self.port_file)
        for flag, port in (("--port", self.port), ("--registry-port", self.registry_port)):
            if not 0 <= port < 65536:
                raise ConfigError(f"{flag} must be in 0..65535, got {port}")
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ConfigError("--transfer-backend must be mooncake or tcp")
        if self.hicache_storage_backend not in HICACHE_STORAGE_BACKENDS:
            raise ConfigError("--hicache-storage-backend must be file or mooncake")
        if why := endpoint_problem(self.otlp_traces_endpoint):
            raise ConfigError(f"--otlp-traces-endpoint {self.otlp_traces_endpoint!r}: {why}")
        if self.node_threads < 0:
            raise ConfigError("--node-threads must be >= 0 (0: split the cores)")
        if self.startup_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ConfigError("--startup-timeout-s and --stop-timeout-s must be > 0")
        for flag, text in (("--node-args", self.node_args), ("--prefill-args", self.prefill_args),
                           ("--decode-args", self.decode_args),
                           ("--router-args", self.router_args)):
            try:
                shlex.split(text)
            except ValueError as exc:
                raise ConfigError(f"{flag}: {exc}") from None

    def node_argv(self, role: str) -> list[str]:
        """The extra flags of a `role` node: --node-args, then that role's own (later flags
        win: argparse keeps the last)."""
        own = self.prefill_args if role == "prefill" else self.decode_args
        return shlex.split(self.node_args) + shlex.split(own)


@dataclass(frozen=True)
class DemoConfig:
    stack: StackConfig
    # Sized for ~40 s on 2 CPU cores with smollm2-135m, below the point where queueing
    # dominates TTFT (about 1 request/s there).
    num_prompts: int = _opt(32, "requests of the load test")
    request_rate: float = _opt(1.0, "requests/s (Poisson arrivals)")
    input_len: int = _opt(128, "prompt tokens per request")
    output_len: int = _opt(32, "output tokens per request")
    max_concurrency: int = _opt(8, "most requests in flight (0: unbounded)")
    backend: str = _opt("openai", "API the load test uses: openai (completions), "
                                  "openai-chat, or generate",
                        choices=("openai", "openai-chat", "generate"))
    output_file: str = _opt("", "also append the load test's JSON line to this file")

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
        if not self.request_rate > 0 or self.max_concurrency < 0:
            raise ValueError("--request-rate must be > 0 and --max-concurrency >= 0")


DEMO_STACK_DEFAULTS = {"model": "smollm2-135m", "port": 0}


def add_flags(p: argparse.ArgumentParser, cls: type, title: str,
              defaults: dict | None = None, skip: tuple[str, ...] = ()) -> None:
    add_dataclass_flags(p, cls, title, defaults=defaults, skip=skip)


def stack_from_cli(args: argparse.Namespace, **overrides) -> StackConfig:
    values = values_from(StackConfig, args)
    token = read_token_file(values["registry_token_file"], "--registry-token-file")
    if token is not None:
        values["registry_token"] = token
    return replace(StackConfig(**values), **overrides) if overrides else StackConfig(**values)


def demo_from_cli(args: argparse.Namespace) -> DemoConfig:
    values = values_from(DemoConfig, args, skip=("stack",))
    return DemoConfig(stack=stack_from_cli(args), **values)
