"""`pdserve registry`: flags -> RegistryConfig -> store -> uvicorn.

Imported by `pdserve.cli` for every command, so only argparse and the config dataclass
load at import time; FastAPI, uvicorn and redis load inside `run`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from dataclasses import fields
from pathlib import Path

from bootstrap.config import HTTP_DEFAULTS, RegistryConfig
from pdserve.flags import ConfigError, add_dataclass_flags, values_from
from pdserve.http.limits import HttpLimits

_DEFAULTS = RegistryConfig()


_DESCRIPTION = (
    "Bootstrap registry: nodes register and heartbeat, the router and decode nodes look "
    "them up (docs/architecture.md: Registry)."
)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `pdserve registry` on the `pdserve` command's subparsers."""
    p = sub.add_parser(
        "registry",
        help="run the bootstrap registry (node discovery with TTL heartbeats)",
        description=_DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m bootstrap.cli [flags]`: the same command without loading the rest of
    pdserve's CLI (whose other subcommands import the engine)."""
    p = argparse.ArgumentParser(
        prog="python -m bootstrap.cli",
        description=_DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_flags(p)
    return run(p.parse_args(argv))


def add_flags(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    g = add_dataclass_flags(p, RegistryConfig, "registry", skip=_BY_HAND)
    # A secret may come from a file instead (it stays out of argv): each of these two
    # flags shares a mutually exclusive group with its -file twin.
    store = g.add_mutually_exclusive_group()
    store.add_argument("--store", default=d.store, help=_field_help("store"))
    store.add_argument(
        "--store-file", type=Path, default=None,
        help="read --store from this file (a Redis URL with a password stays out of argv)",
    )
    tok = g.add_mutually_exclusive_group()
    tok.add_argument("--token", default=d.token, help=_field_help("token"))
    tok.add_argument(
        "--token-file", type=Path, default=None, help="read --token from this file instead"
    )
    add_dataclass_flags(p, HttpLimits, "HTTP limits", defaults=HTTP_DEFAULTS)
    p.set_defaults(func=run)


_BY_HAND = ("store", "token", "http")  # RegistryConfig fields with hand-written flags


def _field_help(name: str) -> str:
    return next(f.metadata["help"] for f in fields(RegistryConfig) if f.name == name)


def config_from_args(args: argparse.Namespace) -> RegistryConfig:
    token = args.token
    if args.token_file is not None:
        try:
            token = args.token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"--token-file: {exc}") from None
    store = args.store
    if args.store_file is not None:
        try:
            store = args.store_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"--store-file: {exc}") from None
    return RegistryConfig(store=store, token=token,
                          http=HttpLimits(**values_from(HttpLimits, args)),
                          **values_from(RegistryConfig, args, skip=_BY_HAND))


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"pdserve registry: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("pdserve.registry")

    import uvicorn

    from bootstrap.app import create_app
    from bootstrap.store import StoreUnavailable, open_store
    from pdserve.http.guard import guarded_protocol
    from pdserve.http.listening import ListeningServer
    from pdserve.ports import PortInUse, bind_port, listen_port

    try:  # bound first: a taken port is one clear line; 0 picks a free one
        sock = bind_port(config.host, config.port)
        listen_port(sock, config.host, config.port)
    except PortInUse as exc:
        print(f"pdserve registry: {exc}", file=sys.stderr)
        return 1
    with sock:
        try:
            store = open_store(config.store, key_prefix=config.key_prefix)
            store.ping()  # fail fast: a registry that cannot reach its store serves nothing
        except (StoreUnavailable, ValueError) as exc:
            print(f"pdserve registry: cannot use store {config.store!r}: {exc}",
                  file=sys.stderr)
            return 1
        log.info("config %s", config.describe())
        # It logs `listening on URL` and writes --port-file once it serves. Access logs
        # only at debug: every node heartbeats every TTL/3.
        server = ListeningServer(uvicorn.Config(
            create_app(config, store), host=config.host, port=sock.getsockname()[1],
            log_level=config.log_level, access_log=config.log_level == "debug",
            http=guarded_protocol(config.http)), sock, config.port_file, log)
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: a stop asked for
            server.run()
    if server.port_file_error:
        return 1
    return 0 if server.started else 3  # uvicorn's exit code for a failed start


if __name__ == "__main__":
    sys.exit(main())
