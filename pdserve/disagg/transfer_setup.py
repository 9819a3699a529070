"""Register an engine's KV pool and metadata rows with the KV transfer layer."""

from __future__ import annotations

from kv_transfer import KVArgs, KVManager, KVTransferConfig
from pdserve.disagg.metadata import MetadataPool


def make_kv_manager(engine, role: str, meta: MetadataPool, cfg: KVTransferConfig,
                    model_name: str) -> KVManager:
    """The pool's per-layer K/V buffers are registered as they are: page p means the same
    bytes on every layer of both nodes (docs/architecture.md: Memory)."""
    pool = engine.kv_pool
    args = KVArgs.from_tensors(pool.k_buffers, pool.v_buffers, pool.page_size, model_name,
                               meta_bufs=[meta.buffer])
    return KVManager(args, role, cfg)
