"""Which device a node's KV pool lands on, answered without importing torch when it can be.

Importing torch costs ~2.5 s of CPU; the processes that ask this (a node's HTTP process at
its transfer preflight, `pdserve up`) never run a forward. An explicit `--device`
needs no import, nor does `auto` with a CPU-only torch wheel (`2.13.0+cpu`), which can
never see a GPU; otherwise torch is asked.
"""

from __future__ import annotations

import importlib.metadata


def cpu_only_torch() -> bool:
    """The installed torch is a CPU wheel: no device but the CPU exists."""
    try:
        return importlib.metadata.version("torch").endswith("+cpu")
    except importlib.metadata.PackageNotFoundError:
        return False


def kv_device_type(device: str) -> str:
    """'cpu' or 'cuda': where `--device` (auto|cpu|cuda[:N]) puts the KV pool. An explicit
    device is taken as asked (the engine refuses one that does not exist)."""
    if device != "auto":
        return device.split(":")[0]
    if cpu_only_torch():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_torch_device(device: str):
    """`--device` (auto|cpu|cuda|cuda:N) as the one `torch.device` every engine thread uses.

    A CUDA device always carries its index: `torch.cuda.set_device`, streams and events
    resolve an index-less `cuda` with `torch._utils._get_device_index(optional=False)`,
    which raises, and a thread that dies on it leaves the scheduler waiting. So `cuda`
    becomes `cuda:<current device>` here, once (0 where torch cannot see a GPU: that
    device is then refused when the engine first touches it, with CUDA's own message).
    """
    import torch

    dev = torch.device(kv_device_type("auto") if device == "auto" else device)
    if dev.type == "cuda" and dev.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        dev = torch.device("cuda", index)
    return dev


def torch_cuda_version() -> str | None:
    """The CUDA version torch was built for (None for a CPU build)."""
    if cpu_only_torch():
        return None
    import torch

    return torch.version.cuda
