"""`RegistryConfig`: every knob of `pdserve registry`, one CLI flag each, frozen."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdserve.flags import ConfigError, opt
from pdserve.http.limits import HttpLimits
from pdserve.ports import check_port_file

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
HTTP_DEFAULTS = {"max_body_bytes": 65536, "max_connections": 1024}


@dataclass(frozen=True)
class RegistryConfig:
    host: str = opt("127.0.0.1", "address to bind")
    port: int = opt(8998, "port to bind (0: a free one the OS picks; the registry logs it)")
    port_file: str | None = opt(None, "once the registry serves, write its port (decimal and "
                                      "a newline) to this file, atomically: how a parent "
                                      "that started it with --port 0 learns the port",
                                metavar="PATH")
    # "memory" (embedded, one process) or a Redis URL (replicas share it, restarts keep it).
    # Its flag shares a group with --store-file (bootstrap/cli.py).
    store: str = opt("memory", "'memory' (embedded, one process) or redis://HOST:PORT/DB "
                               "(shared by replicas)")
    # Redis keys live under this prefix, so one Redis can hold several registries.
    key_prefix: str = opt("pdserve:registry:", "prefix of every Redis key")
    # Bearer token for writes (PUT/DELETE); None: writes are open. Flag beside --token-file.
    token: str | None = opt(None, "bearer token required for PUT/DELETE")
    # Also require the token on reads (GET /v1/nodes...); /health stays open for probes.
    token_reads: bool = opt(False, "also require the token for GET /v1/nodes*")
    # TTL of a record whose registration names none; nodes renew every TTL/3.
    default_ttl_s: float = opt(10.0, "seconds a record lives when its registration names "
                                     "no ttl_s", flag="--default-ttl")
    # Bounds on a requested TTL: too short floods the registry, too long keeps the dead.
    min_ttl_s: float = opt(0.5, "smallest ttl_s accepted", flag="--min-ttl")
    max_ttl_s: float = opt(3600.0, "largest ttl_s accepted", flag="--max-ttl")
    log_level: str = opt("info", "", choices=LOG_LEVELS)
    # The HTTP bounds (body size: 413 before any parsing); the registry's bodies are small
    # records and its clients a cluster's nodes, hence its smaller defaults.
    http: HttpLimits = field(default_factory=lambda: HttpLimits(**HTTP_DEFAULTS))

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        check_port_file(self.port_file)
        if self.store != "memory" and not self.store.startswith(REDIS_SCHEMES):
            raise ConfigError(
                f"--store must be 'memory' or a redis://HOST:PORT/DB URL, got {self.store!r}"
            )
        if self.token is not None and not self.token.strip():
            raise ConfigError("--token must not be empty")
        if self.token_reads and self.token is None:
            raise ConfigError("--token-reads needs --token (or --token-file)")
        if not 0 < self.min_ttl_s <= self.default_ttl_s <= self.max_ttl_s <= 86400:
            raise ConfigError(
                "need 0 < --min-ttl <= --default-ttl <= --max-ttl <= 86400, got "
                f"{self.min_ttl_s}, {self.default_ttl_s}, {self.max_ttl_s}"
            )
        if self.http.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-bytes must be >= 1024, got "
                              f"{self.http.max_body_bytes}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")

    def describe(self) -> dict[str, object]:
        """Config for the startup log line, secrets masked."""
        data = dataclasses.asdict(self)
        if self.token is not None:
            data["token"] = "***"
        scheme, sep, rest = self.store.partition("://")
        if sep and "@" in rest.split("/", 1)[0]:  # redis://user:password@host
            data["store"] = f"{scheme}://***@{rest.split('@', 1)[1]}"
        return data
