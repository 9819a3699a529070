"""Server-sent events as pdserve's servers write them and its clients (the router's decode
leg, the load tester) read them back: `data: <JSON object>` lines, `data: [DONE]` at the
end; blank lines, comments (`: keepalive`) and other fields carry nothing."""

from __future__ import annotations

import json

DONE = "[DONE]"


def sse(obj: dict) -> str:
    """One event as written: `data: <JSON>` and the blank line that ends it."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class SSEFormatError(ValueError):
    """A `data:` line that is neither `[DONE]` nor a JSON object."""


def parse_data_line(line: str) -> dict | str | None:
    """One SSE line -> a JSON object, DONE, or None. Raises SSEFormatError."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == DONE:
        return DONE
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        raise SSEFormatError(f"bad SSE data: {data[:120]!r}")
    return obj
