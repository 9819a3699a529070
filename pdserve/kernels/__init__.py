"""Builds and loads pdserve's fused CPU kernels (cpu_ops.cpp) as a torch C++ extension.

The extension (cpu_ops.cpp with its bindings; extend_attention.cpp and decode_bf16.cpp, the
AVX512-BF16 attention kernels, the prompt one on AMX tiles where the CPU has AMX (amx.h);
decode_avx2.cpp, decode attention on AVX2 without AVX-512; the helpers in vec.h) comes from
one of two places, in order:
1. a build made ahead of time for an ISA level this CPU runs (pdserve/kernels/prebuilt.py:
   an image's builder stage makes them, so pods need no compiler);
2. a build made here with `-march=native`, once per source, torch version, compiler, CPU
   kind and Python ABI, into `$XDG_CACHE_HOME/pdserve/kernels/<hash>/` (`~/.cache` by default;
   `python -m pdserve.kernels` builds it ahead of time, scripts/setup.sh does), shared by
   every checkout and virtualenv of the same sources and torch. Making it needs a C++
   compiler and `ninja`; loading it later imports the .so alone (a millisecond, where
   torch's JIT loader spends most of a second asking ninja whether it is up to date).
   `-march=native` is safe because it runs where it was built.
Where neither works, `load_cpu_ops()` returns None with the reason in `build_error()`, and
the model runs its torch reference ops instead (pdserve/models/ops.py). `build_id()` names
the build in use (/server_info: `engine.kernels_build`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from pdserve.kernels import prebuilt

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.cpp"))  # one extension; the bindings are in cpu_ops.cpp
_state: dict[str, object] = {}
STALE_BUILD_S = 3600.0  # a private build folder this old was left by a killed build


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
def compiler() -> bytes:
    """The first line of `c++ --version` (the compiler torch's build runs, `$CXX` when set):
    objects of another compiler version are not reused."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, timeout=30,
                             check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return b"no compiler"
    return out.splitlines()[0] if out else b"unknown compiler"


@functools.cache
def sources_hash() -> str:
    """sha256 of the kernel sources' text (the .cpp files and the headers). Read once per
    process: a load asks twice (the prebuilt builds' manifests, the native build's folder)
    and the sources do not change while it runs."""
    text = b"".join(p.read_bytes() for p in [*SOURCES, *sorted(HERE.glob("*.h"))])
    return hashlib.sha256(text).hexdigest()


def _python_abi() -> bytes:
    """The extension suffix (`.cpython-311-x86_64-linux-gnu.so`): a build links one Python's
    ABI, and virtualenvs of two Pythons with the same torch version share the cache."""
    return (sysconfig.get_config_var("EXT_SUFFIX") or sys.version).encode()


def cache_dir() -> Path:
    """One build folder per source text, torch version, compiler, CPU kind and Python ABI
    (its name is the build's id in /server_info: `engine.kernels_build`). It holds only the
    finished `.so`: the build runs in a private folder beside it (see _build_native), so checkouts
    and virtualenvs share the folder without rebuilding it in turn (torch writes their
    paths into build.ninja) and a process killed mid-build leaves no lock file behind."""
    key = hashlib.sha256(sources_hash().encode() + torch.__version__.encode() + compiler()
                         + _cpu_flags() + _python_abi()).hexdigest()[:12]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "pdserve" / "kernels" / key


def load_cpu_ops(verbose: bool = False) -> ModuleType | None:
    """The compiled module, or None when it cannot be built here (reason: build_error())."""
    if "module" in _state:
        return _state["module"]  # type: ignore[return-value]
    module = _load_prebuilt()
    if module is None:
        module = _load_native(verbose)
    _state["module"] = module
    return module


def _load_prebuilt() -> ModuleType | None:
    pre = prebuilt.usable(sources_hash())
    if pre is None:
        return None
    try:
        module = prebuilt.load(pre)
    except Exception as exc:  # a damaged file: say so, build here instead
        log.warning("prebuilt kernels %s do not load (%s: %s); building here", pre.path,
                    type(exc).__name__, exc)
        return None
    _state["build"] = pre.build_id
    log.info("fused CPU kernels: prebuilt for %s (%s)", pre.level, pre.path)
    return module


def _load_native(verbose: bool) -> ModuleType | None:
    build = cache_dir()
    name = f"pdserve_cpu_ops_{build.name}"
    so = build / f"{name}.so"
    try:
        module = _import_made(name, so) or _build_native(build, name, so, verbose)
    except Exception as exc:  # compiler, ninja or headers missing: fall back, say why
        _state["error"] = f"{type(exc).__name__}: {str(exc).strip()[-400:]}"
        log.warning("fused CPU kernels unavailable, using torch ops: %s", _state["error"])
        return None
    _state["build"] = build.name
    return module


def _import_made(name: str, so: Path) -> ModuleType | None:
    """The build made earlier, or None when there is none or it does not import (a
    truncated file, say: it is built again and replaced)."""
    if not so.exists():
        return None
    try:
        return prebuilt.import_so(name, so)
    except ImportError as exc:
        log.warning("fused CPU kernels %s do not load (%s); building again", so, exc)
        return None


def _build_native(build: Path, name: str, so: Path, verbose: bool) -> ModuleType:
    """Compile in a private folder inside `build` and import the result from there (torch's
    JIT loader does both), then publish the .so at `so` with an atomic rename. Two processes
    building at once both compile and publish the same bytes; neither waits on the other."""
    from torch.utils import cpp_extension

    build.mkdir(parents=True, exist_ok=True)
    for stale in build.glob(".build-*"):  # a build killed mid-way (one takes minutes)
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > STALE_BUILD_S:
                shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=build) as tmp:
        module = cpp_extension.load(
            name=name, sources=[str(p) for p in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
            build_directory=tmp, verbose=verbose)
        staged = Path(tmp, f"{name}.so.publish")
        shutil.copy2(Path(tmp, f"{name}.so"), staged)
        os.replace(staged, so)
    return module


def build_error() -> str | None:
    return _state.get("error")  # type: ignore[return-value]


def build_id() -> str | None:
    """The loaded build's id: `prebuilt-<level>-<hash>` or the native build's cache folder
    name (see cache_dir); None before a successful load_cpu_ops()."""
    return _state.get("build")  # type: ignore[return-value]


