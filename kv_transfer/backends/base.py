"""The interface every transfer backend implements.

A backend moves bytes from this process's registered memory into a peer's registered
memory (push model: prefill writes into decode). `write`, `probe` and `recreate` are
called from the manager's single transfer thread only; `forget_peer` and `session` may be
read from any thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kv_transfer.lease import WriteFence
from kv_transfer.runs import Entries


class BackendUnavailable(RuntimeError):
    """The backend cannot run in this process (e.g. Mooncake not importable)."""


class TransferBackend(ABC):
    name: str

    @property
    @abstractmethod
    def session(self) -> str:
        """Address under which peers write into this process ("host:port")."""

    @abstractmethod
    def register(self, regions: list[tuple[int, int]]) -> None:
        """Make (pointer, length) regions readable and writable by peers."""

    @abstractmethod
    def write(self, session: str, entries: Entries, room: int | None = None) -> int:
        """Write all entries into peer `session`; 0 on success, negative on failure.
        `room` names the transfer, for receivers that fence writes (set_write_fence)."""

    @abstractmethod
    def probe(self, session: str) -> bool:
        """True when the peer answers (used to tell a poisoned path from a dead peer)."""

    @abstractmethod
    def recreate(self) -> None:
        """Drop all engine state and start afresh with the same registered regions."""

    def set_write_fence(self, fence: WriteFence) -> bool:
        """Receiving side: apply incoming writes through `fence`; True when done.
        Backends whose writes are one-sided (Mooncake) cannot: their receivers rely on
        write leases and quarantine (decode_control.py)."""
        return False

    def forget_peer(self, session: str) -> None:  # noqa: B027 - optional hook
        """The peer was declared dead: abort waits on it where the backend can."""

    @abstractmethod
    def close(self) -> None:
        """Release the engine; no call may follow."""
