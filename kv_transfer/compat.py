"""Start-up refusal of transfer set-ups that cannot work (docs/architecture.md: KV transfer,
Device memory).

`transfer_refusal` is a pure decision on facts gathered by `gather_facts` (or injected by a
test): where the KV pool lives, which backend was asked for, which Mooncake build is
installed and whether it imports, and torch's CUDA version. It returns one message naming
the fix, or None. A node prints the message and exits non-zero before loading the model.

KV layout/dtype mismatches between two nodes cannot be seen at start-up (nodes start
independently); they are refused at the handshake instead: the router only pairs nodes whose
registry records agree, and a prefill refuses a decode peer's `Register` whose layout
differs (`prefill_peers.check_register`).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

# PyPI distribution -> the build it is. Each installs the same `mooncake` package.
MOONCAKE_BUILDS = {
    "mooncake-transfer-engine-non-cuda": "non-cuda",
    "mooncake-transfer-engine": "cuda12",
    "mooncake-transfer-engine-cuda13": "cuda13",
}
CUDA_FIX = ("install a CUDA build of Mooncake: pip install 'pdserve[cuda]' "
            "(mooncake-transfer-engine-cuda13 for CUDA 13; mooncake-transfer-engine for "
            "CUDA 12), or use --transfer-backend tcp (stages KV through pinned host memory)")


@dataclass(frozen=True)
class TransferFacts:
    kv_device: str  # "cpu" | "cuda" (torch device type of the KV pool)
    backend: str  # "mooncake" | "tcp"
    mooncake_builds: tuple[str, ...]  # installed builds (values of MOONCAKE_BUILDS)
    mooncake_error: str | None  # why `mooncake.engine` does not import, None when it does
    torch_cuda: str | None = None  # torch.version.cuda, e.g. "13.0"


def installed_mooncake_builds() -> tuple[str, ...]:
    """Builds whose distribution is installed (several can be: they overwrite each other)."""
    names = {(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()}
    return tuple(build for dist, build in MOONCAKE_BUILDS.items() if dist in names)


def transfer_refusal(f: TransferFacts) -> str | None:
    """Why this node cannot move its KV with the chosen backend (one line), or None."""
    if f.backend != "mooncake":
        return None  # tcp works with host pools and (through the bounce buffer) GPU pools
    builds = f.mooncake_builds
    if f.mooncake_error is not None:
        want = "a CUDA build of Mooncake (pip install 'pdserve[cuda]')" if f.kv_device == \
            "cuda" else "mooncake-transfer-engine-non-cuda (pip install 'pdserve[mooncake]')"
        return (f"the mooncake transfer backend is unavailable ({f.mooncake_error}); install "
                f"{want} and Debian's libibverbs1, or use --transfer-backend tcp")
    if len(builds) > 1:
        return (f"several Mooncake builds are installed ({', '.join(builds)}) and overwrite "
                "each other; uninstall all but one")
    if f.kv_device != "cuda":
        return None  # every build registers host memory
    if builds == ("non-cuda",):
        return ("the KV cache is on cuda but the installed Mooncake build "
                "(mooncake-transfer-engine-non-cuda) cannot register GPU memory; " + CUDA_FIX)
    major = (f.torch_cuda or "").split(".")[0]
    if builds and builds[0].startswith("cuda") and major and builds[0] != f"cuda{major}":
        return (f"the installed Mooncake build is for {builds[0]} but torch uses CUDA "
                f"{f.torch_cuda}; " + CUDA_FIX)
    return None  # a CUDA build, or a build of unknown origin (e.g. from source)


# The pdserve extra that installs each Mooncake build (pyproject.toml).
BUILD_OF_EXTRA = {"mooncake": "non-cuda", "cuda12": "cuda12", "cuda": "cuda13"}


def image_refusal(extras: str, torch_cuda: str | None) -> str | None:
    """Why an image built with `--build-arg EXTRAS=extras` over a torch for `torch_cuda`
    (None: a CPU torch) would have its GPU nodes refuse to start, or None. Decided at
    build time, without a GPU: a CUDA build's engine cannot import without the driver, so
    only the build/torch match is checked (the node checks the import at start)."""
    builds = tuple(BUILD_OF_EXTRA[e] for e in extras.split(",") if e in BUILD_OF_EXTRA)
    if torch_cuda is None:
        if any(b != "non-cuda" for b in builds):
            return (f"EXTRAS={extras} installs a CUDA build of Mooncake over a CPU torch; "
                    "use EXTRAS=mooncake")
        return None
    if not builds:
        return None  # no Mooncake: the nodes run --transfer-backend tcp
    problem = transfer_refusal(TransferFacts("cuda", "mooncake", builds, None, torch_cuda))
    if problem is not None:
        build = f"cuda{torch_cuda.split('.')[0]}"
        want = next((e for e, b in BUILD_OF_EXTRA.items() if b == build), "cuda")
        return f"EXTRAS={extras} with torch for CUDA {torch_cuda}: {problem}; use EXTRAS={want}"
    return None
