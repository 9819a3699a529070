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
# Set, not defaulted: some machine images export their own choice for the whole system
# (OPENBLAS_CORETYPE=Haswell on a Zen 5 host, which OpenBLAS does not know), and that
# kernel is one of the row-position-dependent ones.
# tests/kernels/test_triton_attention.py checks that numpy's matmul is row-position exact.
if platform.machine() in ("x86_64", "AMD64"):
    os.environ["OPENBLAS_CORETYPE"] = "Sandybridge"

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The files that take longest (seconds on a 2-core machine, `--durations`), longest first:
# with two pytest-xdist workers (`--no-loadscope-reorder`, scripts/test.sh) they start
# first, so that the run does not end with one worker alone on one of them while the other
# idles. Every other file keeps its collection order after them.
LONGEST_FIRST = (
    "tests/router/test_router_faults.py",  # 220
    "tests/soak/test_chaos_quick.py",  # 150
    "tests/plan/test_profile.py",  # 120
    "tests/interop/test_sglang_router.py",  # 110
    "tests/pd/test_pd_fencing.py",  # 105
    "tests/pd/test_pd_process.py",  # 105
    "tests/router/test_hicache_storage_stack.py",  # 95
    "tests/router/test_router_registry_outage.py",  # 95
    "tests/pd/test_pd_tp.py",  # 85
    "tests/engine/test_engine_greedy_hf.py",  # 80
    "tests/engine/test_triton_batch_invariant.py",  # 80
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable


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


@pytest.fixture(scope="module", autouse=True)
def _free_module_memory():
    """When a test module ends, close the engines and drop the reference models it loaded
    (engine_helpers' LLMs, pd_pair's reference engines and shared weights, transformers'
    models). Cached across the session they added up to ~10 GB in one pytest process; with
    two pytest-xdist workers on a 24 GiB machine that was the OOM killer. Per module, memory
    stays bounded by one module's models; a later module reloads what it uses (seconds).
    Only helpers that were imported are touched: they live in test folders."""
    yield
    import ctypes
    import gc
    import sys

    helpers = sys.modules.get("engine_helpers")
    if helpers is not None:
        helpers.close_all()
        helpers.drop_hf_models()
    pd_pair = sys.modules.get("pd_pair")
    if pd_pair is not None:
        pd_pair.close_references()
    reference = sys.modules.get("hf_reference")
    if reference is not None:
        reference.hf_greedy.cache_clear()
        reference.hf_model.cache_clear()
    gc.collect()
    if sys.platform == "linux":
        # glibc keeps freed heap pages mapped; hand them back so that the freed models
        # really leave this process's RSS (what the OOM killer counts).
        ctypes.CDLL(None).malloc_trim(0)
