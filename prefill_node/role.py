"""The prefill role (docs/architecture.md: Request lifecycles, PD bookkeeping). Life of a request
on a prefill node:

1. Arrival. The /generate leg carries `bootstrap_room`; a KVSender is made for the room
   and the request waits in the bootstrap queue. It will compute exactly one token.
2. Bootstrap, or early start. The request takes a metadata slot, `init`s the sender and
   enters the waiting queue as soon as either the decode side has pre-allocated and said
   where to write (sender reaches WaitingForInput), or, before that, it fits under the
   early-start cap: the prompt pages of every request started early and not yet accepted
   by its decode stay within `early_start_kv_fraction` of the KV pool (0: never). An early
   request is watched in `early` until its decode's Request is accepted; its sender queues
   every page sent before that and writes them once the destination is known. A decode
   that never asks fails the room by the bootstrap timeout (step 6 frees everything); one
   whose pre-allocation does not fit (page size, page count) fails it at acceptance.
3. Admission. Prefix pages already valid in the radix cache go out at once (early send),
   except pages a host-tier load is still writing (`loading_pages`).
4. Chunks. Scheduling a chunk records its `tmp_end_idx` and counts an in-flight middle
   chunk; processing its result (the forward is then known complete) sends the whole pages
   it finished, as `SendProgress` decides. Under the overlap loop that processing runs while
   the next batch's forward runs, and two chunks of one request may be in flight at once.
   Results of chunks whose request was aborted meanwhile are dropped.
5. Last chunk. The first token is sampled; the request moves to the inflight queue, still
   holding its KV, and the rest of the pages (partial last page too) go out with the
   metadata row (room, first token). Started early, it may get here before its decode
   asked: it waits in the inflight queue like any other, its pages queued on the sender.
6. Inflight. The sender is polled until Success (done; KV goes to the prefix cache) or
   Failed (the error is reported); then the KV and metadata slot are freed.
Abort or failure at any stage aborts the sender (so the decode leg fails fast) and frees
everything once no launched batch and no transfer can read it.
"""

from __future__ import annotations

import logging

from kv_transfer import KVPoll, KVSender, KVTransferConfig
from pdserve.engine.batch import Batch
from pdserve.engine.request import Req, ReqState
from pdserve.engine.role import RoleContext
from pdserve.pd.leg import PDLegFields
from pdserve.pd.metadata import pack_row
from pdserve.pd.tp_transfer import TPSender
from pdserve.pd.transfer_role import TransferRole
from pdserve.tracing.marks import Timeline, now_ns
from prefill_node.bookkeeping import SendProgress
from prefill_node.state import PrefillState, prefill_state

log = logging.getLogger("pdserve.prefill")


class PrefillRole(TransferRole):
    name = "prefill"
    meta_rows_per_request = 4
    overlap_every_prefill = True  # launch N+1, then process N (first token, KV sends)
    runs_decode = False  # its requests decode on the decode node: no decode CUDA graphs

    def __init__(self, transfer: KVTransferConfig, model_name: str, early_send: bool = True,
                 early_start_kv_fraction: float = 0.25):
        super().__init__(transfer, model_name)
        if not 0.0 <= early_start_kv_fraction <= 1.0:
            raise ValueError(f"early_start_kv_fraction must be in [0, 1], got "
                             f"{early_start_kv_fraction}")
        self.early_send = early_send
        self.early_start_kv_fraction = early_start_kv_fraction
        self.bootstrap: list[Req] = []  # step 2
        self.inflight: list[Req] = []  # step 6
        self.live: list[Req] = []  # past bootstrap, not yet in inflight: watched for failure
        self.early: list[Req] = []  # started early, decode's Request not yet accepted
        self.early_pages = 0  # prompt pages of `early`: what the cap bounds
        self.early_sent_pages = 0
        self.early_started = 0  # requests started before their decode asked (counter)

    def attach(self, ctx: RoleContext) -> None:
        super().attach(ctx)
        self.page_size = ctx.kv.page_size
        self.pool_pages = ctx.kv_pool.num_pages

    # 1. arrival --------------------------------------------------------------------------
    def add_request(self, req: Req, leg: PDLegFields | None) -> None:
        # Types and ranges were checked when `leg` was built (pdserve/pd/leg.py).
        if leg is None or leg.bootstrap_room is None:
            raise ValueError("a prefill node needs `bootstrap_room` (an integer in [0, 2^63))")
        room = leg.bootstrap_room
        # The decode node's TP size (the router's; absent: ours, rank to rank).
        d_size = leg.decode_tp_size or self.ctx.tp_size
        req.params.max_new_tokens = 1  # the decode node generates the rest
        ctx = self.ctx
        sender = KVSender(self.mgr, room) if ctx.tp_size == d_size == 1 else TPSender(
            self.mgr, room, ctx.tp, ctx.kv_heads, ctx.tp_size, d_size)
        req.pd = PrefillState(room, sender,
                              SendProgress(len(req.prompt_ids), self.page_size))
        self.bootstrap.append(req)

    def has_work(self) -> bool:
        return bool(self.bootstrap or self.inflight)

    # 2. bootstrap or early start, and 6. inflight ---------------------------------------------
    def poll(self) -> bool:
        for req in list(self.bootstrap):
            state = prefill_state(req).sender.poll()
            if state == KVPoll.Failed:
                self._fail(req, prefill_state(req).sender.failure_reason or "decode peer failed")
            elif state >= KVPoll.WaitingForInput:
                if not self._start(req, early=False):
                    break  # back-pressure: no metadata row free
            elif self._fits_early(req) and not self._start(req, early=True):
                break
        for req in list(self.early):  # accepted by now: no longer counts against the cap
            sender = prefill_state(req).sender
            if sender.poll() >= KVPoll.WaitingForInput:
                self._leave_early(req)
                if req.trace is not None:  # arrival to the decode node's Request
                    at = sender.accepted_at
                    req.trace.span("prefill bootstrap", req.trace.marks["arrived"],
                                   Timeline.wall_ns(at) if at is not None else now_ns())
        for req in list(self.live):
            if prefill_state(req).sender.poll() == KVPoll.Failed and not req.finished:
                self._fail(req, prefill_state(req).sender.failure_reason or "KV transfer failed")
            elif req.load_op:
                self._send_loaded(req)
        for req in list(self.inflight):
            state = prefill_state(req).sender.poll()
            if state.terminal:
                if state == KVPoll.Failed and not req.error:
                    req.error = prefill_state(req).sender.failure_reason or "KV transfer failed"
                if req.trace is not None:
                    _trace_sends(req.trace, prefill_state(req).sender, state == KVPoll.Success)
                self.inflight.remove(req)
                if req in self.early:  # its decode never asked (or it failed first)
                    self._leave_early(req)
                self._free_meta(req)
                self.out.complete(req)
        return False  # no new tokens here: the first token is sampled by a forward

    def _fits_early(self, req: Req) -> bool:
        """Starting `req` before its decode asked keeps the prompt pages of all such
        requests within the early-start cap."""
        need = prefill_state(req).progress.total_pages
        return self.early_pages + need <= self.early_start_kv_fraction * self.pool_pages

    def _leave_early(self, req: Req) -> None:
        self.early.remove(req)
        self.early_pages -= prefill_state(req).progress.total_pages

    def _start(self, req: Req, early: bool) -> bool:
        """Bootstrap queue -> waiting queue with a metadata row (False: none is free)."""
        slot = self.meta.alloc()
        if slot is None:
            return False
        pd = prefill_state(req)
        pd.meta_slot = slot
        pd.sender.init(pd.progress.total_pages, slot)
        if early:
            self.early.append(req)
            self.early_pages += pd.progress.total_pages
            self.early_started += 1
        elif req.trace is not None:  # waited for the decode node's Request
            req.trace.span_since("prefill bootstrap", "arrived")
        self.bootstrap.remove(req)
        self.live.append(req)
        self.queue.add(req)
        return True

    def _fail(self, req: Req, reason: str) -> None:
        req.error = reason
        self.out.finish(req, "error")

    # 3. admission: early send of cached prefix pages ---------------------------------------
    def loading_pages(self, req: Req) -> frozenset[int]:
        """Indices of the request's pages (positions in `req.pages`, not pool ids) that a
        HiCache host->device load is still writing (docs/architecture.md: HiCache)."""
        return self.kv.loading_pages(req)

    def on_admitted(self, req: Req) -> None:
        if not self.early_send or not req.cached_len:
            return
        pages = prefill_state(req).progress.early_send(req.cached_len, self.loading_pages(req))
        self._send(req, pages)
        self.early_sent_pages += len(pages)

    def _send_loaded(self, req: Req) -> None:
        """Cached pages held back because their load was pending go out, in order, as
        soon as the load is done (or with the next chunk result, whichever comes first)."""
        if (not self.early_send or req.state is not ReqState.RUNNING or req.slot is None
                or prefill_state(req).progress.sent_pages >= req.cached_len // self.page_size
                or self.loading_pages(req)):
            return
        pages = prefill_state(req).progress.early_send(req.cached_len)
        self._send(req, pages)
        self.early_sent_pages += len(pages)

    # 4. chunks ------------------------------------------------------------------------------
    def on_extend_scheduled(self, batch: Batch) -> None:
        for row in batch.rows:
            end = row.start + row.q_len
            if bool(row.future_id) != (end == len(row.req.prompt_ids)):
                raise RuntimeError(f"row of {row.req.rid} ends at {end} but samples="
                                   f"{bool(row.future_id)}")
            prefill_state(row.req).progress.chunk_scheduled(end)

    def on_extend_processed(self, batch: Batch) -> None:
        """The batch's forward is done: each row's chunk is sent as the bookkeeping decides
        (runs while the next batch's forward runs, under the overlap loop)."""
        for row in batch.rows:
            req = row.req
            # This forward read every layer of any HiCache load of the request, so the load
            # is complete; wait only for the copy thread to publish that (a few instructions).
            self.kv.wait_loaded(req)
            aborted = req.finish_reason in ("abort", "error")
            pd = prefill_state(req)
            pages, last = pd.progress.chunk_done(aborted, row_end=row.start + row.q_len)
            if last and not aborted:  # 5. the first token is known now
                row_bytes = pack_row(pd.room, req.output_ids[0])
                self._guard(req, pages)
                if req.trace is not None:
                    req.trace.sends.append((now_ns(), len(pages)))
                pd.sender.send([req.pages[p] for p in pages], last=True, metadata=row_bytes)
            else:
                self._send(req, pages)

    # 5. last chunk (and every other end) ------------------------------------------------------
    def hold_on_finish(self, req: Req) -> bool:
        """A normal finish happens while the last chunk's result is processed; its pages
        and metadata row go out right after, in `on_extend_processed`."""
        if req in self.bootstrap:  # no KV yet
            self.bootstrap.remove(req)
            prefill_state(req).sender.abort(req.error or "aborted")
            return False
        if req in self.live:
            self.live.remove(req)
        if req.finish_reason in ("abort", "error"):
            prefill_state(req).sender.abort(req.error or req.finish_reason)
        self.inflight.append(req)
        return True

    def may_retract(self, req: Req) -> bool:
        return False  # pages may already be queued on the sender: never take them back

    def abort_held(self, req: Req) -> bool:
        """An abort while the KV is being sent (inflight queue): stop the transfer so the
        decode leg fails fast; the KV is freed once the sender is terminal."""
        if req not in self.inflight or prefill_state(req).sender.poll().terminal:
            return False
        req.error, req.finish_reason = "aborted", "abort"
        prefill_state(req).sender.abort("aborted")
        return True

    def _send(self, req: Req, pages: range) -> None:
        if len(pages):
            self._guard(req, pages)
            if req.trace is not None:
                req.trace.sends.append((now_ns(), len(pages)))
            prefill_state(req).sender.send([req.pages[p] for p in pages])

    def _guard(self, req: Req, pages: range) -> None:
        """Never hand the sender a page a HiCache load is still writing: it would ship
        whatever the freed device page held before."""
        loading = self.loading_pages(req)
        if loading and any(p in loading for p in pages):
            raise RuntimeError(f"refusing to send pages of {req.rid} whose HiCache load is "
                               f"pending: {sorted(loading.intersection(pages))}")

    def stats(self) -> dict:
        return {"bootstrap_queue": len(self.bootstrap), "inflight_queue": len(self.inflight),
                "free_metadata_slots": self.meta.num_free,
                "total_metadata_slots": self.meta.size, "early_sent_pages": self.early_sent_pages,
                "early_started": self.early_started, "early_start_queue": len(self.early),
                "transfer": self.mgr.metrics()}



def _trace_sends(trace: Timeline, sender: KVSender | TPSender, ok: bool) -> None:
    """One "kv send" span per send() of a traced request: from the call to its transfer job
    being written (the sender's per-job times: rank 0's with TP; a send with no time yet
    ends now)."""
    done = sender.jobs_done_at
    end = now_ns()
    for i, (start, pages) in enumerate(trace.sends):
        written = Timeline.wall_ns(done[i]) if i < len(done) else end
        trace.span("kv send", start, written, pages=pages, last=int(i == len(trace.sends) - 1),
                   ok=int(ok))
    trace.sends.clear()
