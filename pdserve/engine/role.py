"""The seam where a node role plugs into the shared engine (composition, docs/architecture.md:
Roles).

The engine calls these hooks at fixed points of a request's life; the colocated role
(this base class) does nothing special. `prefill_node.PrefillRole` and
`decode_node.DecodeRole` override them to add their queues and KV transfers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.batch import Batch
    from pdserve.engine.engine import Engine
    from pdserve.engine.request import Req


class Role:
    name = "colocated"
    # True: the overlap loop never syncs before a prefill batch that follows a prefill
    # batch, whatever `consecutive_prefill` says (the prefill role: all its batches are).
    overlap_every_prefill = False

    def attach(self, engine: Engine) -> None:
        self.engine = engine

    def add_request(self, req: Req, extra: dict) -> None:
        """A validated new request: colocated requests go straight to the waiting queue."""
        if extra:
            raise ValueError(f"unexpected fields for a colocated node: {sorted(extra)}")
        self.engine.sched.add(req)

    def poll(self) -> bool:
        """Once per loop iteration, before scheduling: advance role-owned queues. Returns
        True when requests got new output tokens here (a decode node's first tokens,
        carried over with the KV), so a server can stream them before the next batch."""
        return False

    def has_work(self) -> bool:
        """Requests held in role-owned queues (not visible to the scheduler)."""
        return False

    def on_admitted(self, req: Req) -> None:
        """`req` got its request slot and cached prefix (scheduler thread)."""

    def on_extend_scheduled(self, batch: Batch) -> None:
        """An extend batch was built and is about to launch."""

    def on_extend_processed(self, batch: Batch) -> None:
        """The result of an extend batch was processed: its KV is valid now."""

    def hold_on_finish(self, req: Req) -> bool:
        """`req` just finished (done, aborted or failed), wherever it was, role-owned queues
        included. True: the role keeps its KV and calls `engine.out.complete` later."""
        return False

    def may_retract(self, req: Req) -> bool:
        """False for requests whose KV a transfer may still be reading."""
        return True

    def abort_held(self, req: Req) -> bool:
        """Abort a finished request whose KV the role still holds (e.g. being sent)."""
        return False

    def registry_fields(self) -> dict:
        """The transfer part of this node's registry record ({} on a colocated node)."""
        return {}

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        """Stop role-owned threads (the transfer manager)."""
