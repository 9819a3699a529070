"""One TransferManager per node: registers the node's KV and metadata buffers with the transfer
engine once, and runs the background threads that own the sockets and the engine.

Threads (all daemons, all joined by close()):
- prefill: a control thread (bound ROUTER for decode peers) and the single transfer
  thread that makes every engine call;
- decode: a control thread (one DEALER per prefill peer); the engine is passive there
  (prefill writes into decode memory), except the tcp backend's receiving thread.
Create managers inside the process that uses them, never before a fork.
"""

from __future__ import annotations

import logging
import uuid
from concurrent.futures import Future
from typing import Any, Literal, TypeVar

from kv_transfer.args import KVArgs
from kv_transfer.backends import TransferBackend, create_backend
from kv_transfer.config import KVTransferConfig
from kv_transfer.decode_control import DecodeControl
from kv_transfer.lease import WriteFence
from kv_transfer.memory import HostMemory
from kv_transfer.messages import Register
from kv_transfer.metrics import TransferStats
from kv_transfer.prefill_control import PrefillControl
from kv_transfer.wake import Wake
from kv_transfer.worker import JobResult, TransferWorker

log = logging.getLogger(__name__)
Role = Literal["prefill", "decode"]
T = TypeVar("T")


class TransferManager:
    def __init__(self, args: KVArgs, role: Role, config: KVTransferConfig | None = None,
                 memory: HostMemory | None = None) -> None:
        """`memory`: how registered KV bytes are read and written (HostMemory by default;
        a BounceMemory for KV on a GPU, docs/architecture.md: KV transfer)."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"unknown role {role!r} (prefill|decode)")
        self.args, self.role = args, role
        self.config = config or KVTransferConfig()
        self.instance = uuid.uuid4().hex
        self.stats = TransferStats()
        self.memory = memory or HostMemory()
        # Written on every state change of this node's rooms (kv_transfer/wake.py): the
        # scheduler waits on it instead of polling its rooms on a timer.
        self.wake = Wake()
        self._backend = create_backend(self.config, self.memory,
                                       on_stranger=lambda: self.stats.inc("stranger_writes"))
        self._closed = False
        try:
            self._backend.register(args.regions())
            self._start_threads()
        except BaseException:
            self._backend.close()
            self.wake.close()
            raise

    def _start_threads(self) -> None:
        self._worker: TransferWorker | None = None
        self._prefill: PrefillControl | None = None
        self._decode: DecodeControl | None = None
        if self.role == "prefill":
            self._prefill = PrefillControl(
                self.args, self.config, self._backend.name, self.instance, self.stats,
                submit=lambda job: self._worker_or_fail().submit(job),
                forget_peer=self._backend.forget_peer)
            self._worker = TransferWorker(self._backend, self.config, self.stats,
                                          on_result=self._on_job_result, memory=self.memory)
            self._prefill.start()
        else:
            fence: WriteFence | None = WriteFence(lambda: self.stats.inc("fenced_writes"))
            assert fence is not None
            if not self._backend.set_write_fence(fence):
                fence = None  # one-sided writes: nothing on our side sees them
            self._decode = DecodeControl(self.args, self.config, self._registration(),
                                         self.stats, fence, memory=self.memory)
            self._decode.start()

    def _worker_or_fail(self) -> TransferWorker:
        assert self._worker is not None
        return self._worker

    def _on_job_result(self, res: JobResult) -> None:
        ctl = self._prefill
        assert ctl is not None
        ctl.post(lambda: ctl.on_result(res))

    def _registration(self) -> Register:
        a, lay = self.args, self.args.layout
        return Register(
            instance=self.instance, session=self._backend.session, backend=self._backend.name,
            model=lay.model, page_size=lay.page_size, num_layers=lay.num_layers,
            num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim, dtype=lay.dtype,
            page_bytes=a.page_bytes, num_pages=a.num_pages, k_ptrs=list(a.k_ptrs),
            v_ptrs=list(a.v_ptrs), buf_lens=list(a.buf_lens), meta_ptrs=list(a.meta_ptrs),
            meta_row_bytes=list(a.meta_row_bytes), meta_rows=a.meta_rows,
            tp_rank=lay.tp_rank, tp_size=lay.tp_size, token=self.config.token)

    # ---- what the node publishes --------------------------------------------------------

    @property
    def endpoint(self) -> str | None:
        """host:port of the control socket decode peers connect to (prefill only)."""
        return self._prefill.endpoint if self._prefill is not None else None

    @property
    def transfer_session(self) -> str:
        """Where peers write into this node (changes when the engine is re-created)."""
        return self._backend.session

    @property
    def backend_name(self) -> str:
        return self._backend.name

    def registry_fields(self) -> dict[str, Any]:
        """The transfer part of this node's bootstrap-registry record (docs/architecture.md:
        Registry)."""
        lay = self.args.layout
        return {
            "kv_endpoint": self.endpoint or "", "transfer_session": self.transfer_session,
            "transfer_backend": self.backend_name, "model": lay.model,
            "page_size": lay.page_size,
            "kv_layout": {"num_layers": lay.num_layers, "num_kv_heads": lay.num_kv_heads,
                          "head_dim": lay.head_dim, "dtype": lay.dtype},
        }

    def metrics(self) -> dict[str, Any]:
        """Counters, plus `live_rooms`: rooms the control thread still tracks (0 once every
        request has ended, whatever the failures; len() of its dict is safe to read from
        another thread) and, on a decode, the quarantined rooms and their pages (failed
        rooms a silent prefill may still write: decode_control.py)."""
        control = self._prefill if self._prefill is not None else self._decode
        live = control.num_rooms() if control is not None else 0
        out = {**self.stats.snapshot(), "live_rooms": live}
        if self._decode is not None:
            out["quarantined_rooms"] = self._decode.num_quarantined()
            out["quarantined_pages"] = self._decode.quarantined_pages
        return out

    # ---- engine access (prefill) ----------------------------------------------------------

    def run_on_transfer_thread(self, fn: Any) -> Future[Any]:
        """Run fn(backend) on the transfer thread, the only thread that may call the engine."""
        if self._worker is None:
            raise RuntimeError("only a prefill manager has a transfer thread")
        return self._worker.call(fn)

    def recreate_engine(self) -> Future[None]:
        """Force the poisoned-path recovery: new engine, memory registered again."""
        worker = self._worker
        if worker is None:
            raise RuntimeError("only a prefill manager re-creates its engine")
        return worker.call(lambda _backend: worker.recreate())

    # ---- internal hooks for KVSender / KVReceiver ---------------------------------------

    def _prefill_control(self) -> PrefillControl:
        if self._prefill is None:
            raise RuntimeError("KVSender needs a prefill TransferManager")
        return self._prefill

    def _decode_control(self) -> DecodeControl:
        if self._decode is None:
            raise RuntimeError("KVReceiver needs a decode TransferManager")
        return self._decode

    @property
    def backend(self) -> TransferBackend:
        return self._backend

    # ---- shutdown -----------------------------------------------------------------------

    def close(self, timeout: float = 10.0) -> bool:
        """Stop all threads and release the engine; True when every thread ended."""
        if self._closed:
            return True
        self._closed = True
        ok = True
        # Worker first: it posts results into the control loop. A worker still stuck in a
        # write keeps the control socket open: a closed one tells the decode we are gone
        # and may no longer write (decode_control.py); process exit closes it after the
        # write was cut off.
        if self._worker is not None and not self._worker.stop(timeout):
            log.warning("kv manager: the transfer thread did not stop within %.1fs", timeout)
            return False
        for part in (self._prefill, self._decode):
            if part is not None:
                ok &= part.stop(timeout)
        self._backend.close()
        self.wake.close()
        if not ok:
            log.warning("kv manager: a background thread did not stop within %.1fs", timeout)
        return ok

    def __enter__(self) -> TransferManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
