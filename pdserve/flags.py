"""One `--flag` per field of a frozen config dataclass (docs/architecture.md: Interfaces).

Every process kind's config is a frozen dataclass built once from the command line; this
module is the one place that turns its fields into argparse flags and back, so a field and
its flag cannot drift apart. A field's help text lives in its metadata (`opt(...)`), or in
a `help` mapping the caller passes; other metadata (`choices`, `required`, `nargs`,
`metavar`, and `type`: a converter such as `comma_list(float)` that replaces the field's
scalar type) goes to argparse. A flag is named after its field (`drain_timeout_s` ->
`--drain-timeout-s`) unless its metadata's `flag` says otherwise (`opt(..., flag=)`, or a
plain `metadata` dict in a package that does not import this module); argparse then stores
it under the flag's own name, so two configs' fields of one name (`host`) never collide.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, field, fields
from typing import Any, TypeVar

_TYPES = {"int": int, "float": float, "str": str}
T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration that cannot work. Raised by a config's `__post_init__` with the flag
    named; every CLI prints it on one line and exits non-zero."""


def opt(default: Any, help: str, *, flag: str | None = None, **extra: Any) -> Any:
    """A dataclass field with its flag's help text, name (default: the field's) and
    argparse extras attached. `default=MISSING` with `required=True`: a required flag."""
    meta = {"help": help, **extra}
    if flag is not None:
        meta["flag"] = flag
    if default is MISSING:
        return field(metadata=meta)
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable default: use a tuple")
    return field(default=default, metadata=meta)


def comma_list(kind: Callable[[str], T]) -> Callable[[str], tuple[T, ...]]:
    """A flag's converter (`opt(..., type=comma_list(float))`) for a tuple field given as
    one comma-separated value: "1,2,inf" -> (1.0, 2.0, inf); blank items are skipped."""
    name = getattr(kind, "__name__", "value")

    def convert(text: str) -> tuple[T, ...]:
        try:
            return tuple(kind(part.strip()) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {name} values, got {text!r}") from None

    return convert


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _flag(f: Field) -> str:
    return f.metadata.get("flag") or flag_name(f.name)


def _dest(f: Field) -> str:
    return _flag(f).lstrip("-").replace("-", "_")


def _kind(f: Field) -> type:
    """The scalar type argparse converts to: `int`, `float | None` -> float, `tuple[str,
    ...]` -> str (with nargs), anything else str."""
    if isinstance(f.type, type):
        return f.type
    name = str(f.type).split("|")[0].strip()
    if name.startswith("tuple["):
        name = name[len("tuple["):].split(",")[0].strip()
    return _TYPES.get(name, str)


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, title: str, *,
                        defaults: Mapping[str, Any] | None = None, skip: tuple[str, ...] = (),
                        help: Mapping[str, str] | None = None, show_default: bool = False
                        ) -> argparse._ArgumentGroup:
    """Register one flag per field of `cls` in a new argument group: booleans as
    store_true (`--x/--no-x` when the default is True), int/float as typed values,
    tuples with `nargs`, anything else as a string. Returns the group (for flags that are
    no field, such as a secret's `-file` twin)."""
    group = parser.add_argument_group(title)
    for f in fields(cls):
        if f.name in skip:
            continue
        text = f.metadata.get("help") or (help or {}).get(f.name, "")
        extra = {k: v for k, v in f.metadata.items() if k not in ("help", "flag", "type")}
        flag, dest = _flag(f), _dest(f)
        default = (defaults or {}).get(f.name, f.default)
        if f.type in ("bool", bool):
            action = argparse.BooleanOptionalAction if default is True else "store_true"
            group.add_argument(flag, dest=dest, action=action, default=bool(default),
                               help=text, **extra)
            continue
        if default is MISSING:
            assert extra.get("required"), f"{cls.__name__}.{f.name} needs a default"
            default = None
        elif isinstance(default, tuple):
            default = list(default) if default else None
        if show_default:  # argparse fills it in; a defaults formatter then adds no second
            text = f"{text} (default: %(default)r)"
        group.add_argument(flag, dest=dest, type=f.metadata.get("type") or _kind(f),
                           default=default, help=text, **extra)
    return group


def values_from(cls: type, args: argparse.Namespace, skip: tuple[str, ...] = ()
                ) -> dict[str, Any]:
    """The parsed value of every field of `cls` (the inverse of add_dataclass_flags);
    `nargs` lists come back as tuples."""
    out: dict[str, Any] = {}
    for f in fields(cls):
        if f.name in skip:
            continue
        value = getattr(args, _dest(f))
        if str(f.type).startswith("tuple["):
            value = tuple(value or ())
        out[f.name] = value
    return out
