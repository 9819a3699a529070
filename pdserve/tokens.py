"""Tokens read from files (`--registry-token-file`): a Kubernetes Secret mounted as a file
keeps the token out of argv, where any process on the host could read it in /proc."""

from __future__ import annotations

from pathlib import Path


def read_token_file(path: Path | str | None, flag: str) -> str | None:
    """The token in `path` (surrounding whitespace dropped); None without a path. Raises
    ValueError (the CLI's one-line error) when the file cannot be read or is empty."""
    if path is None or str(path) == "":
        return None
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    if not token:
        raise ValueError(f"{flag}: {path} is empty")
    return token
