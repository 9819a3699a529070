"""Suite-wide: without a GPU, Triton kernels run in Triton's CPU interpreter; that is how
the CUDA attention kernels are tested on a CPU machine. Set before any test imports
Triton, and inherited by the nodes the tests start. With CUDA the kernels compile."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def native():
    """The fused CPU kernels (pdserve/kernels) as `NativeOps`; they must build on the test
    machine (the engine's and the kernels' tests use them). Imported here, not at the top:
    TRITON_INTERPRET must be set before anything of pdserve loads Triton."""
    from pdserve.kernels import build_error, load_cpu_ops
    from pdserve.models.ops import NativeOps

    module = load_cpu_ops()
    assert module is not None, f"the kernels must build on the test machine: {build_error()}"
    return NativeOps(module)
