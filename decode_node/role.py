"""The decode role (docs/architecture.md: Request lifecycles, KV transfer). Life of a request on a
decode node:

1. Arrival. The /generate leg carries `bootstrap_room` and the prefill node's KV endpoint
   (the HTTP front looked `prefill_node_id` up in the registry and checked the layout).
   A KVReceiver is made for the room; the request waits in the pre-allocation queue.
2. Pre-allocation. In arrival order, a request is admitted only when the scheduler's
   admission rule (`Scheduler.can_admit`) lets it: its prompt pages plus the decode
   reservation of everything running or transferring, and the pages that retracted
   requests wait for (else it waits: back-pressure, never failure). It gets a request
   slot, its prompt pages (a cached prefix is reused and not transferred) and a metadata
   slot; `init` tells the prefill where to write.
3. Transfer queue. The receiver is polled. Success: the metadata row's room stamp is
   checked, the first token is committed, and the request joins the running batch as
   already prefilled (it never runs prefill here). Failed: the request ends with the
   error and everything it held is freed.
4. Decode. The shared overlap loop decodes it with FutureMap token resolution;
   retraction under KV pressure re-prefills it locally from prompt + outputs.
Abort at any stage: a receiver still transferring is aborted and its pages are freed
only once it is Failed (then no write from the prefill can land any more). A transfer that
fails while the prefill may still be writing (it went silent mid-transfer) is `doomed`
first: the request ends with the error at once, its pages and metadata row wait in
`draining` until the receiver is Failed (quarantine, kv_transfer/decode_control.py).
"""

from __future__ import annotations

import logging

from decode_node.state import DecodeState, decode_state
from kv_transfer import KVPoll, KVReceiver, KVTransferConfig
from pdserve.engine.request import Req
from pdserve.engine.role import RoleContext
from pdserve.pd.leg import PDLegFields
from pdserve.pd.metadata import unpack_row
from pdserve.pd.tp_transfer import TPReceiver
from pdserve.pd.transfer_role import TransferRole
from pdserve.tracing.marks import Timeline

log = logging.getLogger("pdserve.decode")


class DecodeRole(TransferRole):
    name = "decode"
    meta_rows_per_request = 2

    def __init__(self, transfer: KVTransferConfig, model_name: str) -> None:
        super().__init__(transfer, model_name)
        self.prealloc: list[Req] = []  # step 2
        self.transferring: list[Req] = []  # step 3
        # Ended while the prefill may still write their pages (aborted, or doomed while
        # transferring): they keep pages and metadata row until the receiver is Failed.
        self.draining: list[Req] = []

    def attach(self, ctx: RoleContext) -> None:
        super().attach(ctx)
        self.max_requests = ctx.max_running_requests

    # 1. arrival ------------------------------------------------------------------------------
    def add_request(self, req: Req, leg: PDLegFields | None) -> None:
        # Types and ranges were checked when `leg` was built (pdserve/pd/leg.py); the
        # decode_tp_size of a prefill leg is ignored: we know our own.
        if leg is None or leg.bootstrap_room is None:
            raise ValueError("a decode node needs `bootstrap_room` (an integer in [0, 2^63))")
        room = leg.bootstrap_room
        endpoints = list(leg.prefill_kv_endpoints)
        if not endpoints:
            raise ValueError("a decode node needs `prefill_node_id` of a live prefill node")
        endpoint = endpoints[0]
        # The prefill node computes the prompt's logprobs (and the first token's); the
        # router merges them in (docs/architecture.md: Logprobs).
        req.params.prompt_logprobs = None
        ctx = self.ctx
        receiver: KVReceiver | TPReceiver
        if len(endpoints) == ctx.tp_size == 1:
            receiver = KVReceiver(self.mgr, room, endpoint)
        else:  # KV sliced by heads between the two TP sizes
            try:
                receiver = TPReceiver(self.mgr, room, ctx.tp, ctx.kv_heads, ctx.tp_size,
                                      endpoints)
            except ValueError as exc:
                raise ValueError(f"KV of a prefill node of TP {len(endpoints)} cannot be "
                                 f"sliced for this decode node of TP {ctx.tp_size}: {exc}"
                                 ) from None
        req.pd = DecodeState(room, receiver)
        self.prealloc.append(req)

    def has_work(self) -> bool:
        return bool(self.prealloc or self.transferring or self.draining)

    def poll(self) -> bool:
        self._poll_prealloc()
        committed = self._poll_transfers()
        for req in list(self.draining):
            if decode_state(req).receiver.poll().terminal:
                self.draining.remove(req)
                self._free_meta(req)
                self.out.complete(req, cache_it=False)
        return committed

    # 2. pre-allocation ----------------------------------------------------------------------------
    def _poll_prealloc(self) -> None:
        while self.prealloc:
            req = self.prealloc[0]
            if decode_state(req).receiver.poll() == KVPoll.Failed:
                self.prealloc.pop(0)
                self._fail(req, decode_state(req).receiver.failure_reason or "prefill peer failed",
                           decode_state(req).receiver.peer_fault)
                continue
            if not self._try_allocate(req):
                return  # FIFO: later requests wait behind the head
            self.prealloc.pop(0)
            self.transferring.append(req)

    def _try_allocate(self, req: Req) -> bool:
        """Pre-allocate under the scheduler's admission rule, with the requests still
        transferring counted as soon-to-run; while retracted requests wait for pages the
        rule keeps those pages for them (no new pre-allocation takes them)."""
        busy = self.queue.num_requests() + len(self.transferring)
        if busy >= self.max_requests or self.meta.num_free == 0:
            return False
        if not self.queue.can_admit(req, len(req.prompt_ids), handover=self.transferring):
            return False
        req.fill_ids = list(req.prompt_ids)
        if not self.kv.preallocate(req, len(req.prompt_ids)):
            return False
        pd = decode_state(req)
        pd.meta_slot = slot = self.meta.alloc()
        assert slot is not None  # num_free > 0 checked above
        first = req.cached_len // self.kv.page_size
        pd.receiver.init(req.pages[first:], slot, prefix_len=req.cached_len)
        if req.trace is not None:  # waited for pages and a metadata row
            req.trace.span_since("decode prealloc", "arrived", pages=len(req.pages) - first)
            req.trace.mark("kv_wait")
        return True

    # 3. transfer queue --------------------------------------------------------------------
    def _poll_transfers(self) -> bool:
        """True when a transfer completed (its request now has its first token)."""
        committed = False
        for req in list(self.transferring):
            state = decode_state(req).receiver.poll()
            if state == KVPoll.Success and self.kv.loading_pages(req):
                continue  # its cached prefix is still loading from the HiCache host tier
            if state == KVPoll.Success:
                self.transferring.remove(req)
                if req.trace is not None:
                    _trace_receive(req.trace, decode_state(req).receiver)
                self._commit(req)
                committed = True
            elif state == KVPoll.Failed or decode_state(req).receiver.doomed:
                self.transferring.remove(req)
                self._fail(req, decode_state(req).receiver.failure_reason or "KV transfer failed",
                           decode_state(req).receiver.peer_fault)
        return committed

    def _commit(self, req: Req) -> None:
        room, token, _ = unpack_row(decode_state(req).receiver.metadata()[0])
        self._free_meta(req)
        if room != decode_state(req).room:
            self._fail(req, f"metadata row carries room {room}, expected {decode_state(req).room}")
            return
        req.output_ids = [token]
        if req.params.logprobs is not None:
            req.output_logprobs = [None]  # the prefill node's answer carries this entry
        req.launched_outputs = 1
        reason = self.out.stop_reason(req)  # the first token may already end it
        if reason:
            self.out.finish(req, reason)  # never joins the running batch
        else:
            self.queue.add_prefilled(req)

    def _fail(self, req: Req, reason: str, prefill_fault: bool = False) -> None:
        """End `req` with the error. Its KV is freed now when the receiver is terminal (no
        write can land), else once it is (`hold_on_finish`). `prefill_fault`: the prefill
        node caused it; the client (the router) is told so with the error code
        `prefill_failed`, to blame that node and retry elsewhere."""
        if decode_state(req).receiver.poll().terminal:
            self._free_meta(req)
        req.error = f"KV transfer from the prefill node failed: {reason}" if prefill_fault \
            else reason
        req.error_code = "prefill_failed" if prefill_fault else None
        self.out.finish(req, "error", cache_it=False)

    # any end -------------------------------------------------------------------------------------
    def hold_on_finish(self, req: Req) -> bool:
        if req in self.prealloc:
            self.prealloc.remove(req)
            decode_state(req).receiver.abort(req.error or "aborted")
            return False
        if req in self.transferring:  # the prefill may still write into its pages
            self.transferring.remove(req)
            decode_state(req).receiver.abort(req.error or "aborted")
            self.draining.append(req)
            return True
        pd = decode_state(req) if req.pd is not None else None
        if pd is not None and pd.meta_slot is not None and not pd.receiver.poll().terminal:
            self.out.report(req)  # doomed: the client hears now, the pages wait
            self.draining.append(req)
            return True
        return False

    def stats(self) -> dict:
        return {"prealloc_queue": len(self.prealloc), "transfer_queue": len(self.transferring),
                "free_metadata_slots": self.meta.num_free,
                "total_metadata_slots": self.meta.size,
                "draining": len(self.draining), "transfer": self.mgr.metrics()}



def _trace_receive(trace: Timeline, receiver: KVReceiver | TPReceiver) -> None:
    """"decode receive": from asking the prefill for the KV to the transfer thread seeing
    the last write (rank 0's with TP); "decode commit": from then to this scheduler step
    picking it up (the loop polls transfers every few ms)."""
    seen = trace.mark("kv_seen")
    done = receiver.finished_at
    arrived = min(Timeline.wall_ns(done), seen) if done is not None else seen
    trace.span("decode receive", trace.marks.get("kv_wait", seen), arrived)
    trace.span("decode commit", arrived, seen)
