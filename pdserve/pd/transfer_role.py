"""What the prefill and decode roles share: a metadata pool and the node's KV transfer set-up
(rank 0's manager and, under TP, the worker ranks'; docs/architecture.md: Roles, KV transfer).
"""

from __future__ import annotations

from kv_transfer import KVTransferConfig
from pdserve.engine.request import Req
from pdserve.engine.role import Role, RoleContext
from pdserve.pd.metadata import MetadataPool
from pdserve.pd.tp_transfer import start_role_transfers, tp_registry_fields


class TransferRole(Role):
    meta_rows_per_request = 1  # metadata pool size per max_running_requests (each role sets it)

    def __init__(self, transfer: KVTransferConfig, model_name: str) -> None:
        self.transfer_cfg = transfer
        self.model_name = model_name

    def attach(self, ctx: RoleContext) -> None:
        super().attach(ctx)
        self.meta = MetadataPool(self.meta_rows_per_request * ctx.max_running_requests)
        self.mgr, self.tp_fields = start_role_transfers(ctx, self.name, self.meta,
                                                        self.transfer_cfg, self.model_name)

    def _free_meta(self, req: Req) -> None:
        pd = req.pd
        if pd is not None and pd.meta_slot is not None:
            self.meta.free(pd.meta_slot)
            pd.meta_slot = None

    def wake_fd(self) -> int | None:
        """Readable on any state change of this node's rooms (rank 0's manager; a TP worker
        rank's transfers are seen through its replies, polled on the timer)."""
        return self.mgr.wake.fileno()

    def drain_wake(self) -> None:
        self.mgr.wake.drain()

    def registry_fields(self) -> dict:
        return tp_registry_fields(self.mgr.registry_fields(), self.model_name, self.tp_fields,
                                  self.ctx.kv_heads)

    def close(self) -> None:
        self.mgr.close()
