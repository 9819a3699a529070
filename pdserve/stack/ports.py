"""Loopback ports for the stack's children (shared helpers live in pdserve.ports)."""

from __future__ import annotations

from pdserve.ports import PortInUse, check_port_free, free_port

__all__ = ["PortInUse", "check_port_free", "free_port"]
