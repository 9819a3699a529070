"""A PD node's start-up check of its KV transfer set-up (docs/architecture.md: KV transfer,
Device memory): gathers the facts for `kv_transfer.compat.transfer_refusal`."""

from __future__ import annotations

from kv_transfer.compat import TransferFacts, installed_mooncake_builds, transfer_refusal


def gather_facts(cfg) -> TransferFacts:
    """`cfg` is a ServerConfig of a prefill or decode node."""
    import torch

    from kv_transfer import mooncake_import_error

    backend = cfg.pd.transfer.backend
    return TransferFacts(
        kv_device=cfg.engine.torch_device().type, backend=backend,
        mooncake_builds=installed_mooncake_builds(),
        mooncake_error=mooncake_import_error() if backend == "mooncake" else None,
        torch_cuda=torch.version.cuda)


def check_transfer_setup(cfg) -> None:
    """Raise RuntimeError with one message naming the fix when the set-up cannot work."""
    reason = transfer_refusal(gather_facts(cfg))
    if reason is not None:
        raise RuntimeError(reason)
