"""A PD node's start-up check of its KV transfer set-up (docs/architecture.md: KV transfer,
Device memory): gathers the facts for `kv_transfer.compat.transfer_refusal`. It runs in the
node's HTTP process, which never loads torch for it (`pdserve.devices`)."""

from __future__ import annotations

from kv_transfer.compat import TransferFacts, installed_mooncake_builds, transfer_refusal
from pdserve.devices import kv_device_type, torch_cuda_version


def gather_facts(cfg) -> TransferFacts:
    """`cfg` is a ServerConfig of a prefill or decode node."""
    from kv_transfer import mooncake_import_error

    backend = cfg.pd.transfer.backend
    mooncake = backend == "mooncake"  # tcp works with every device: nothing else is read
    return TransferFacts(
        kv_device=kv_device_type(cfg.engine.device) if mooncake else "unknown",
        backend=backend, mooncake_builds=installed_mooncake_builds(),
        mooncake_error=mooncake_import_error() if mooncake else None,
        torch_cuda=torch_cuda_version() if mooncake else None)


def check_transfer_setup(cfg) -> None:
    """Raise RuntimeError with one message naming the fix when the set-up cannot work."""
    reason = transfer_refusal(gather_facts(cfg))
    if reason is not None:
        raise RuntimeError(reason)
