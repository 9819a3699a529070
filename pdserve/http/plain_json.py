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


def unsafe_reason(value: Any) -> str | None:
    """Why `value` is not plain JSON (lone surrogate, NaN/Infinity, too deep), or None.
    Iterative, so a hostile nesting depth cannot exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        v, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"{where or 'body'}: nested deeper than {MAX_DEPTH} levels"
        if isinstance(v, str):
            if not _utf8(v):
                return f"{where or 'body'}: string contains a lone surrogate (not valid UTF-8)"
        elif isinstance(v, float):
            if not math.isfinite(v):
                return f"{where or 'body'}: number must be finite"
        elif isinstance(v, dict):
            for k, item in v.items():
                if isinstance(k, str) and not _utf8(k):
                    return f"{where or 'body'}: key contains a lone surrogate"
                stack.append((item, f"{where}.{k}" if where else str(k), depth + 1))
        elif isinstance(v, list | tuple):
            stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(v))
    return None


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
