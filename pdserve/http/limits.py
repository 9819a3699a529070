"""`HttpLimits`: the four bounds every HTTP server of pdserve (node, router, registry,
bootstrap endpoint) puts on its clients, one sub-config and one `--flag` each.

Imported by the configs (and the registry CLI), so it stays light: the uvicorn protocol that
enforces the timeouts and the connection cap is `pdserve.http.guard`; the body limit is a
middleware (`pdserve.http.body_limit`, `bootstrap.body_limit`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.flags import ConfigError, opt


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float = opt(10.0, "a connection must send a request's complete headers "
                                        "within this many seconds; beyond: 408 and closed")
    body_timeout_s: float = opt(30.0, "a request body must arrive within this many seconds "
                                      "of its headers; beyond: 408 and closed")
    max_connections: int = opt(4096, "open HTTP connections; beyond: new ones get 503 and "
                                     "are closed")
    max_body_bytes: int = opt(4 << 20, "largest request body; beyond: 413")

    def __post_init__(self) -> None:
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ConfigError("--header-timeout-s and --body-timeout-s must be > 0")
        if self.max_connections < 1:
            raise ConfigError(f"--max-connections must be >= 1, got {self.max_connections}")
        if self.max_body_bytes < 1:
            raise ConfigError(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")
