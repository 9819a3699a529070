"""Host names in URLs: an IPv6 address must be bracketed (`http://[fd00::1]:30001`), or
every URL parser reads its colons as a port (docs/architecture.md: Registry)."""

from __future__ import annotations


def url_host(host: str) -> str:
    """`host` as it goes between `scheme://` and `:port`."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


def http_url(host: str, port: int) -> str:
    return f"http://{url_host(host)}:{port}"
