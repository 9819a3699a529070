"""Suite-wide: without a GPU, Triton kernels run in Triton's CPU interpreter; that is how
the CUDA attention kernels are tested on a CPU machine. Set before any test imports
Triton, and inherited by the nodes the tests start. With CUDA the kernels compile."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
