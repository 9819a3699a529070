"""Builds and loads pdserve's fused CPU kernels (cpu_ops.cpp) as a torch C++ extension.

The extension (cpu_ops.cpp with its bindings; extend_attention.cpp and decode_bf16.cpp, the
AVX512-BF16 attention kernels; the helpers in vec.h) is compiled once per source, torch
version, compiler, CPU kind and checkout, into `$XDG_CACHE_HOME/pdserve/kernels/<hash>/` (`~/.cache`
by default; `python -m pdserve.kernels` builds it ahead of time, scripts/setup.sh does).
It needs a C++ compiler and `ninja`; where either is missing or the build fails,
`load_cpu_ops()` returns None with the reason in `build_error()`, and the model runs its
torch reference ops instead (pdserve/models/ops.py). `-march=native` is safe because
the build happens on the machine that runs it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.cpp"))  # one extension; the bindings are in cpu_ops.cpp
_state: dict[str, object] = {}


def _cpu_flags() -> bytes:
    """The CPU's model and ISA flags: `-march=native` code is only valid where they match
    (a home directory shared by machines of different kinds)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep).encode()


@functools.cache
def _compiler() -> bytes:
    """The first line of `c++ --version` (the compiler torch's build runs, `$CXX` when set):
    objects of another compiler version are not reused."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, timeout=30,
                             check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return b"no compiler"
    return out.splitlines()[0] if out else b"unknown compiler"


def cache_dir() -> Path:
    """One build folder per source text, torch version, compiler, CPU kind and checkout
    (its name is the build's id in /server_info: `engine.kernels_build`). The checkout
    counts because torch writes the sources' paths into build.ninja: two checkouts sharing
    a folder would rebuild it in turn, and a process killed mid-build leaves torch's lock
    file behind, on which every later load waits forever."""
    text = b"".join(p.read_bytes() for p in [*SOURCES, *sorted(HERE.glob("*.h"))])
    key = hashlib.sha256(text + torch.__version__.encode() + _compiler() + _cpu_flags()
                         + str(HERE.resolve()).encode()).hexdigest()[:12]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "pdserve" / "kernels" / key


def load_cpu_ops(verbose: bool = False) -> ModuleType | None:
    """The compiled module, or None when it cannot be built here (reason: build_error())."""
    if "module" in _state:
        return _state["module"]  # type: ignore[return-value]
    module = None
    try:
        from torch.utils import cpp_extension

        build = cache_dir()
        build.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(
            name=f"pdserve_cpu_ops_{build.name}", sources=[str(p) for p in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
            build_directory=str(build), verbose=verbose)
        _state["build"] = build.name
    except Exception as exc:  # compiler, ninja or headers missing: fall back, say why
        _state["error"] = f"{type(exc).__name__}: {str(exc).strip()[-400:]}"
        log.warning("fused CPU kernels unavailable, using torch ops: %s", _state["error"])
    _state["module"] = module
    return module


def build_error() -> str | None:
    return _state.get("error")  # type: ignore[return-value]


def build_id() -> str | None:
    """The loaded build's id (its cache folder's name, see cache_dir); None before a
    successful load_cpu_ops()."""
    return _state.get("build")  # type: ignore[return-value]


def main() -> int:
    module = load_cpu_ops(verbose="-v" in sys.argv)
    if module is None:
        print(f"pdserve kernels: not built ({build_error()})", file=sys.stderr)
        return 1
    print(f"pdserve kernels: ready in {cache_dir()}")
    return 0
