"""Suite-wide: without a GPU, Triton kernels run in Triton's CPU interpreter; that is how
the CUDA attention kernels are tested on a CPU machine. Set before any test imports
Triton, and inherited by the nodes the tests start. With CUDA the kernels compile."""

import os
import platform

# Triton's interpreter runs `tl.dot` as numpy.matmul, i.e. OpenBLAS. OpenBLAS's AVX2 GEMM
# kernels (Haswell, Zen; picked on AVX2-only CPUs) give a row bits that depend on where the
# row sits in the tile, which the batch-invariance tests of the Triton kernels would read as
# a kernel bug. Its AVX kernel (Sandybridge, runs on every x86-64 CPU with AVX) computes each
# row alone. Set before numpy loads (torch loads it); the nodes the tests start inherit it.
# tests/kernels/test_triton_attention.py checks that numpy's matmul is row-position exact.
if platform.machine() in ("x86_64", "AMD64"):
    os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

import pytest  # noqa: E402
import torch  # noqa: E402

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
