"""Register an engine's KV pool and metadata rows with the KV transfer layer."""

from __future__ import annotations

from typing import cast

from kv_transfer import KVArgs, KVTransferConfig, TransferManager
from kv_transfer.manager import Role as TransferSide
from pdserve.memory.kv_pool import KVPool
from pdserve.pd.metadata import MetadataPool


def make_kv_manager(pool: KVPool, role: str, meta: MetadataPool, cfg: KVTransferConfig,
                    model_name: str, tp: tuple[int, int] = (0, 1)) -> TransferManager:
    """The pool's per-layer K/V buffers are registered as they are: page p means the same
    bytes on every layer of both nodes (docs/architecture.md: Memory). `tp`: (rank, size) of
    this pool's node; the pool holds that rank's KV heads. A pool on a GPU is
    read and written through a pinned bounce buffer (docs/architecture.md: KV transfer)."""
    args = KVArgs.from_tensors(pool.k_buffers, pool.v_buffers, pool.page_size, model_name,
                               meta_bufs=[meta.buffer], tp=tp)
    memory = None
    if pool.k_buffers[0].device.type != "cpu":
        from pdserve.pd.bounce import BounceMemory

        memory = BounceMemory([*pool.k_buffers, *pool.v_buffers, meta.buffer])
    # The manager checks `role` is prefill or decode (a ValueError otherwise).
    return TransferManager(args, cast(TransferSide, role), cfg, memory=memory)
