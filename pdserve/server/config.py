"""Node server configuration: one frozen dataclass built once from the CLI."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from pdserve.config import EngineConfig
from pdserve.disagg.config import PDConfig
from pdserve.http.guard import HttpLimits
from pdserve.http.tools import PARSERS
from pdserve.models.tokenizer import read_chat_template


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str = ""  # "" = the --model value
    max_queued_requests: int = 256  # waiting-queue bound; beyond it requests get 429
    request_timeout_s: float = 600.0  # whole-request bound; beyond it 408
    max_body_bytes: int = 4 << 20  # larger bodies get 413
    # prompt + max_tokens beyond the context: clip max_tokens instead of answering 400
    truncate_max_tokens: bool = False
    header_timeout_s: float = 10.0  # a request's headers must arrive within this; then 408
    body_timeout_s: float = 30.0  # ... and its body within this after the headers
    max_connections: int = 4096  # open HTTP connections; beyond it new ones get 503
    max_n: int = 16  # largest `n` (choices of one OpenAI request); beyond it 400
    # A scheduler loop iteration stuck this long dumps the stacks and exits (0: off).
    watchdog_timeout_s: float = 300.0
    log_level: str = "info"
    chat_template: str = ""  # a Jinja file used instead of the model's chat template
    tool_call_parser: str = "auto"  # pdserve.http.tools.PARSERS
    role: str = "colocated"  # colocated | prefill | decode
    pd: PDConfig | None = None  # registry and KV transfer, for prefill/decode nodes

    @property
    def http_limits(self) -> HttpLimits:
        return HttpLimits(self.header_timeout_s, self.body_timeout_s, self.max_connections)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("server")
        g.add_argument("--host", default="127.0.0.1", help="address to bind")
        g.add_argument("--port", type=int, default=30000, help="HTTP port")
        g.add_argument("--served-model-name", default="",
                       help="model name clients use (default: the --model value)")
        g.add_argument("--max-queued-requests", type=int, default=256,
                       help="waiting-queue bound; beyond it requests get HTTP 429")
        g.add_argument("--request-timeout-s", type=float, default=600.0,
                       help="time limit of one request; beyond it HTTP 408")
        g.add_argument("--max-body-bytes", type=int, default=4 << 20,
                       help="largest request body; beyond it HTTP 413")
        g.add_argument("--truncate-max-tokens", action="store_true",
                       help="when prompt + max_tokens exceed the model's context, clip "
                            "max_tokens to what is left instead of answering HTTP 400")
        g.add_argument("--header-timeout-s", type=float, default=10.0,
                       help="a connection must send a request's complete headers within "
                            "this many seconds, or it is answered 408 and closed")
        g.add_argument("--body-timeout-s", type=float, default=30.0,
                       help="a request body must arrive within this many seconds of its "
                            "headers, or it is answered 408 and closed")
        g.add_argument("--max-connections", type=int, default=4096,
                       help="open HTTP connections; beyond it new ones get 503 and close")
        g.add_argument("--max-n", type=int, default=16,
                       help="largest `n` (choices per OpenAI request); beyond it HTTP 400")
        g.add_argument("--watchdog-timeout-s", type=float, default=300.0,
                       help="a scheduler loop iteration with no progress for this long (a "
                            "hung forward or device) dumps every thread's stack and exits, "
                            "so /livez fails and the node is restarted (0: off)")
        g.add_argument("--log-level", default="info",
                       choices=["debug", "info", "warning", "error"])
        g.add_argument("--chat-template", default="",
                       help="Jinja chat template file used instead of the model's (a router "
                            "in front needs the same one)")
        g.add_argument("--tool-call-parser", default="auto", choices=PARSERS,
                       help="how chat answers are read for tool calls: the chat template's "
                            "family (auto), hermes or llama3_json")
        EngineConfig.add_cli_args(p)

    @classmethod
    def from_cli(cls, args: argparse.Namespace, role: str = "colocated") -> ServerConfig:
        if not 0 < args.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {args.port}")
        if args.max_queued_requests < 1 or args.request_timeout_s <= 0:
            raise ValueError("--max-queued-requests and --request-timeout-s must be positive")
        HttpLimits(args.header_timeout_s, args.body_timeout_s, args.max_connections)
        if args.max_n < 1:
            raise ValueError(f"--max-n must be >= 1, got {args.max_n}")
        if args.watchdog_timeout_s < 0:
            raise ValueError(f"--watchdog-timeout-s must be >= 0, got {args.watchdog_timeout_s}")
        if args.chat_template:
            read_chat_template(args.chat_template)  # a bad file fails here, not per request
        return cls(
            engine=EngineConfig.from_cli(args), host=args.host, port=args.port,
            served_model_name=args.served_model_name,
            max_queued_requests=args.max_queued_requests,
            request_timeout_s=args.request_timeout_s, max_body_bytes=args.max_body_bytes,
            truncate_max_tokens=args.truncate_max_tokens,
            header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
            max_connections=args.max_connections, max_n=args.max_n,
            watchdog_timeout_s=args.watchdog_timeout_s, log_level=args.log_level, role=role,
            chat_template=args.chat_template, tool_call_parser=args.tool_call_parser,
            pd=PDConfig.from_cli(args) if role != "colocated" else None,
        )
