"""Is a decoded JSON value safe to pass on and to echo back as JSON?

Python's json module parses `1e999` and `Infinity` as inf and `"\\ud800"` as a string with
a lone surrogate; neither can be written back as valid UTF-8 JSON (httpx, Starlette and
Redis clients then raise mid-request). Every request model of node, router and registry
runs `unsafe_reason` on its raw input, so such values become a 400/422 at the door
instead of an error (or a poisoned record) somewhere later.
"""

from __future__ import annotations

import math
from typing import Any

MAX_DEPTH = 64  # request bodies are shallow; a deeper one is an attack on recursion


# Where a value sits, built only when it is reported: (parent, key, is_index) links.
_Path = tuple[Any, Any, bool] | None


def unsafe_reason(value: Any) -> str | None:
    """Why `value` is not plain JSON (lone surrogate, NaN/Infinity, too deep), or None.
    Iterative, so a hostile nesting depth cannot exhaust the stack.

    It runs on every request body at every hop (router, both nodes), and a prompt's token
    ids are its bulk: ints, bools and None are passed over without being stacked, and an
    item's location is spelled out only for the one reported."""
    stack: list[tuple[Any, _Path, int]] = [(value, None, 0)]
    while stack:
        v, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"{_where(path)}: nested deeper than {MAX_DEPTH} levels"
        if isinstance(v, str):
            if not _utf8(v):
                return f"{_where(path)}: string contains a lone surrogate (not valid UTF-8)"
        elif isinstance(v, float):
            if not math.isfinite(v):
                return f"{_where(path)}: number must be finite"
        elif isinstance(v, dict):
            deep = depth >= MAX_DEPTH  # then even a scalar inside is reported as too deep
            for k, item in v.items():
                if isinstance(k, str) and not _utf8(k):
                    return f"{_where(path)}: key contains a lone surrogate"
                if deep or (item is not None and type(item) not in _SAFE):
                    stack.append((item, (path, k, False), depth + 1))
        elif isinstance(v, list | tuple):
            deep = depth >= MAX_DEPTH
            stack.extend((item, (path, i, True), depth + 1) for i, item in enumerate(v)
                         if deep or (item is not None and type(item) not in _SAFE))
    return None


_SAFE = (int, bool)  # exact types: always plain JSON, nothing inside


def _where(path: _Path) -> str:
    """`a.b[2].c` for a path; "body" for the top."""
    keys = []
    while path is not None:
        path, key, is_index = path
        keys.append((key, is_index))
    where = ""
    for key, is_index in reversed(keys):
        where = f"{where}[{key}]" if is_index else f"{where}.{key}" if where else str(key)
    return where or "body"


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
