"""One `--flag` per field of a frozen config dataclass (docs/architecture.md: Interfaces).

Every process kind's config is a frozen dataclass built once from the command line; this
module is the one place that turns its fields into argparse flags and back, so a field and
its flag cannot drift apart. A field's help text lives in its metadata (`opt(...)`), or in
a `help` mapping the caller passes; other metadata (e.g. `choices`) goes to argparse.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import MISSING, field, fields
from typing import Any

_TYPES = {"int": int, "float": float, "str": str}


class ConfigError(ValueError):
    """A configuration that cannot work. Raised by a config's `__post_init__` with the flag
    named; every CLI prints it on one line and exits non-zero."""


def opt(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field with its flag's help text (and argparse extras) attached."""
    return field(default=default, metadata={"help": help, **extra})


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, title: str, *,
                        defaults: Mapping[str, Any] | None = None, skip: tuple[str, ...] = (),
                        help: Mapping[str, str] | None = None, show_default: bool = False
                        ) -> None:
    """Register one flag per field of `cls` in a new argument group: booleans as
    store_true, int/float as typed values, anything else as a string."""
    group = parser.add_argument_group(title)
    for f in fields(cls):
        if f.name in skip:
            continue
        text = f.metadata.get("help") or (help or {}).get(f.name, "")
        extra = {k: v for k, v in f.metadata.items() if k != "help"}
        if f.type in ("bool", bool):
            group.add_argument(flag_name(f.name), action="store_true", help=text, **extra)
            continue
        default = (defaults or {}).get(f.name, f.default)
        assert default is not MISSING, f"{cls.__name__}.{f.name} needs a default"
        kind = f.type if isinstance(f.type, type) else _TYPES.get(str(f.type), str)
        if show_default:  # argparse fills it in; a defaults formatter then adds no second
            text = f"{text} (default: %(default)r)"
        group.add_argument(flag_name(f.name), type=kind, default=default, help=text, **extra)


def values_from(cls: type, args: argparse.Namespace, skip: tuple[str, ...] = ()
                ) -> dict[str, Any]:
    """The parsed value of every field of `cls` (the inverse of add_dataclass_flags)."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if f.name not in skip}
