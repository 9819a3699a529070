"""Kernel builds made ahead of time, one per ISA level, for machines without a compiler.

An image's builder stage (Dockerfile) runs `python -m pdserve.kernels --prebuild all`: each
level of pdserve/kernels/isa.py is compiled (never imported: the builder's CPU may not run
it) into `<root>/<level>/pdserve_cpu_ops_<level>.so` beside a `manifest.json` naming the
sources' hash, torch version, compiler and flags. The root is `pdserve/kernels/prebuilt/` of
the installed package, so the builds travel with the code they were made from (a volume
mounted on the cache folder does not hide them). At start, `load_cpu_ops()` loads the
highest level this CPU runs whose manifest matches the sources and torch in use; a stale or
foreign build is skipped with the reason logged.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from pdserve.kernels.isa import BY_NAME, IsaLevel, cpu_flags, pick

log = logging.getLogger(__name__)
ROOT = Path(__file__).parent / "prebuilt"
# As the JIT build, less `-march=native`; no debug info (Python's own CFLAGS ask for it:
# 20 MB a build instead of 0.5); -Wno-psabi: GCC notes the ABI of 512-bit vector
# arguments at the AVX2 level, where no such call crosses a library boundary.
CFLAGS = ("-O3", "-fopenmp", "-g0", "-Wno-psabi")
LDFLAGS = ("-fopenmp",)


@dataclass(frozen=True)
class Prebuilt:
    level: str
    path: Path       # the extension's .so
    build_id: str    # `prebuilt-<level>-<sources hash>`, /server_info: engine.kernels_build


def module_name(level: IsaLevel) -> str:
    return f"pdserve_cpu_ops_{level.name}"


def build(levels: tuple[IsaLevel, ...], sources: list[Path], sources_hash: str,
          compiler: str, root: Path = ROOT, verbose: bool = False) -> list[Path]:
    """Compile one extension per level into `root/<level>/` (replacing what was there);
    returns the .so paths. Raises on a failed compile (the image build must fail, not the
    pods). Built with setuptools' BuildExtension, as `pip` builds a torch extension, so
    nothing is imported."""
    from setuptools import Distribution
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    built = []
    for level in levels:
        name = module_name(level)
        out = root / level.name
        with tempfile.TemporaryDirectory(prefix=f"pdserve-kernels-{level.name}-") as tmp:
            ext = CppExtension(name, [str(p) for p in sources],
                               extra_compile_args=[*CFLAGS, *level.cflags],
                               extra_link_args=list(LDFLAGS))
            dist = Distribution({"name": name, "ext_modules": [ext],
                                 "cmdclass": {"build_ext": BuildExtension}})
            dist.script_args = ["-q" if not verbose else "-v", "build_ext",
                                "--build-lib", f"{tmp}/lib", "--build-temp", f"{tmp}/obj"]
            dist.parse_command_line()
            dist.run_commands()
            so = next(Path(tmp, "lib").glob(f"{name}*.so"))
            if out.exists():
                shutil.rmtree(out)
            out.mkdir(parents=True)
            shutil.copy2(so, out / f"{name}.so")
        manifest = {"level": level.name, "module": name, "sources": sources_hash,
                    "torch": torch.__version__, "compiler": compiler,
                    "cflags": [*CFLAGS, *level.cflags], "needs": sorted(level.needs)}
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        built.append(out / f"{name}.so")
    return built


def usable(sources_hash: str, root: Path = ROOT,
           flags: frozenset[str] | None = None) -> Prebuilt | None:
    """The prebuilt to load here: the highest level this CPU runs (`flags`, default: this
    machine's) among the builds in `root` made from these sources for this torch; None
    when there is none (the usual case in a source checkout)."""
    if not root.is_dir():
        return None
    fresh = {}
    for manifest_path in sorted(root.glob("*/manifest.json")):
        try:
            m = json.loads(manifest_path.read_text())
            level, so = m["level"], manifest_path.parent / f"{m['module']}.so"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("prebuilt kernels: unreadable %s (%s)", manifest_path, exc)
            continue
        expected = BY_NAME.get(level)
        if m.get("sources") != sources_hash or m.get("torch") != torch.__version__:
            log.warning("prebuilt kernels %s skipped: built from other sources or torch %s "
                        "(running %s)", level, m.get("torch"), torch.__version__)
        elif expected is None or m.get("cflags") != [*CFLAGS, *expected.cflags]:
            # a level renamed or retargeted since: its code may need what `needs` omits
            log.warning("prebuilt kernels %s skipped: built with flags %s", level,
                        m.get("cflags"))
        elif so.is_file():
            fresh[level] = so
    chosen = pick(cpu_flags() if flags is None else flags, list(fresh))
    if chosen is None:
        if fresh:
            log.info("prebuilt kernels: this CPU runs none of %s", ", ".join(sorted(fresh)))
        return None
    return Prebuilt(chosen.name, fresh[chosen.name],
                    f"prebuilt-{chosen.name}-{sources_hash[:12]}")


def load(pre: Prebuilt) -> ModuleType:
    return import_so(pre.path.stem, pre.path)


def import_so(name: str, path: Path) -> ModuleType:
    """Import an extension module from its file (torch is imported first: the .so links
    libtorch); `name` must be the one it was built under (its PyInit_ symbol)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
