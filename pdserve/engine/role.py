"""The seam where a node role plugs into the shared engine (composition, docs/architecture.md:
Roles).

The engine calls these hooks at fixed points of a request's life; the colocated role
(this base class) does nothing special. `prefill_node.PrefillRole` and
`decode_node.DecodeRole` override them to add their queues and KV transfers.

A role never sees the engine. `attach` hands it a `RoleContext`: the three narrow
collaborators it may call (the scheduler's queue, the output processor, the KV memory
manager), each typed by the Protocol below that lists exactly what a role uses of it, plus
the KV pool it registers with the transfer layer. Calls go one way: the engine calls the
hooks, a role acts only through its context.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pdserve.engine.batch import Batch
    from pdserve.engine.request import Req
    from pdserve.memory.kv_pool import KVPool
    from pdserve.pd.leg import PDLegFields


@runtime_checkable
class RequestQueue(Protocol):
    """What a role may do with the scheduler (`pdserve.engine.scheduler.Scheduler`)."""

    def add(self, req: Req) -> None:
        """Queue `req` for prefill (the waiting queue)."""

    def add_prefilled(self, req: Req) -> None:
        """Put `req`, whose prompt KV and first token are in place, into the running batch."""

    def can_admit(self, req: Req, fill_len: int, handover: Iterable[Req] = ()) -> bool:
        """The node's one admission rule (`Scheduler.admission_pages`)."""

    def num_requests(self) -> int:
        """Requests the scheduler holds (waiting + running)."""


@runtime_checkable
class RequestOutput(Protocol):
    """What a role may do with results (`pdserve.engine.output_processor.OutputProcessor`)."""

    def stop_reason(self, req: Req) -> str | None:
        """Why `req` must stop after its latest token (None: it goes on)."""

    def finish(self, req: Req, reason: str, cache_it: bool = True) -> None:
        """End `req` now (the role's `hold_on_finish` is asked whether it keeps the KV)."""

    def report(self, req: Req) -> None:
        """Report a finished `req` now while the role keeps holding its KV."""

    def complete(self, req: Req, cache_it: bool = True) -> None:
        """Report a finished `req` whose KV the role held (unless `report`ed already);
        its KV is freed when safe."""


@runtime_checkable
class RequestKV(Protocol):
    """What a role may do with KV memory (`pdserve.engine.kv_manager.KVManager`)."""

    page_size: int

    def preallocate(self, req: Req, new_len: int) -> bool:
        """A slot, the cached prefix and pages for `new_len` positions, all or nothing."""

    def loading_pages(self, req: Req) -> frozenset[int]:
        """Indices into `req.pages` a HiCache host->device load is still writing."""

    def wait_loaded(self, req: Req) -> None:
        """Block until `req`'s HiCache load (if any) is published as done."""


@runtime_checkable
class TPReplies(Protocol):
    """The workers' replies about transfers (`engine/tp_driver.py: WorkerReplies`)."""

    def wait_ready(self, timeout: float) -> list[dict]: ...
    def track(self, room: int) -> None: ...
    def forget(self, room: int) -> None: ...
    def states(self, room: int) -> list: ...


@runtime_checkable
class TPWorkers(Protocol):
    """What a role uses of rank 0's TP handle (`engine/tp_driver.py: TPModel`): an op sent
    to every worker rank (in order after everything sent before it), and their replies.
    The PD roles repeat their transfers on the workers with it (pdserve/pd/tp_transfer.py)."""

    @property
    def replies(self) -> TPReplies: ...

    def send_op(self, msg: dict) -> None: ...


@dataclass(frozen=True)
class RoleContext:
    """Everything a role is given of its engine (see the module docstring)."""

    queue: RequestQueue
    output: RequestOutput
    kv: RequestKV
    kv_pool: KVPool  # its buffers are what the transfer layer registers
    max_running_requests: int
    tp_size: int = 1  # ranks of this node (docs/architecture.md: Tensor parallelism)
    tp: TPWorkers | None = None  # rank 0's TPModel when tp_size > 1 (see TPWorkers)
    kv_heads: int = 1  # the model's KV heads (all ranks): how KV is sliced between TP sizes


class Role:
    name = "colocated"
    # True: the overlap loop never syncs before a prefill batch that follows a prefill
    # batch, whatever `consecutive_prefill` says (the prefill role: all its batches are).
    overlap_every_prefill = False
    # False: this role never runs decode batches (the prefill role), so the engine captures
    # no CUDA graphs of them (docs/architecture.md: CUDA graphs).
    runs_decode = True

    def attach(self, ctx: RoleContext) -> None:
        """Called once by the engine, after it built its scheduler, output processor and
        KV manager."""
        self.ctx = ctx
        self.queue, self.out, self.kv = ctx.queue, ctx.output, ctx.kv

    def add_request(self, req: Req, leg: PDLegFields | None) -> None:
        """A validated new request: colocated requests go straight to the waiting queue."""
        if leg is not None:
            raise ValueError("a colocated node takes no PD leg fields (bootstrap_room, ...)")
        self.queue.add(req)

    def poll(self) -> bool:
        """Once per loop iteration, before scheduling: advance role-owned queues. Returns
        True when requests got new output tokens here (a decode node's first tokens,
        carried over with the KV), so a server can stream them before the next batch."""
        return False

    def has_work(self) -> bool:
        """Requests held in role-owned queues (not visible to the scheduler)."""
        return False

    def wake_fd(self) -> int | None:
        """A file descriptor that turns readable when the role's queues may move on (a KV
        transfer changed state; kv_transfer/wake.py), for a loop that only waits on them;
        None: the role has none (the loop polls on its timer)."""
        return None

    def drain_wake(self) -> None:
        """Empty `wake_fd()` after a wake-up, before `poll()`."""

    def on_admitted(self, req: Req) -> None:
        """`req` got its request slot and cached prefix (scheduler thread)."""

    def on_extend_scheduled(self, batch: Batch) -> None:
        """An extend batch was built and is about to launch."""

    def on_extend_processed(self, batch: Batch) -> None:
        """The result of an extend batch was processed: its KV is valid now."""

    def hold_on_finish(self, req: Req) -> bool:
        """`req` just finished (done, aborted or failed), wherever it was, role-owned queues
        included. True: the role keeps its KV and calls `self.out.complete` later."""
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
