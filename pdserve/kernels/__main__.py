"""`python -m pdserve.kernels`: build (or find) the fused CPU kernels ahead of use.

Without flags: load them as a node would (a prebuilt for this CPU, else a native build,
made now when missing) and say which. `--prebuild LEVEL...` compiles builds for other
machines (an image's builder stage); they are not loaded here.
"""

from __future__ import annotations

import argparse
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from pdserve.flags import ConfigError, add_dataclass_flags, opt, values_from
from pdserve.kernels import (
    SOURCES,
    build_error,
    build_id,
    compiler,
    load_cpu_ops,
    prebuilt,
    sources_hash,
)
from pdserve.kernels.isa import BY_NAME, is_x86, parse_levels


@dataclass(frozen=True)
class KernelsConfig:
    prebuild: tuple[str, ...] = opt(
        (), f"compile builds for these ISA levels ({', '.join(BY_NAME)}, or all) instead "
        "of loading one", nargs="+", metavar="LEVEL")
    into: str = opt(str(prebuilt.ROOT), "folder for --prebuild's builds (a node looks "
                    "in the installed package's folder, the default)")
    verbose: bool = opt(False, "show the compiler's commands and output")

    def __post_init__(self) -> None:
        try:
            parse_levels(self.prebuild or ("all",))
        except ValueError as exc:
            raise ConfigError(f"--prebuild: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_flags(parser, KernelsConfig, "kernels")
    try:
        cfg = KernelsConfig(**values_from(KernelsConfig, parser.parse_args(argv)))
    except ConfigError as exc:
        print(f"pdserve kernels: {exc}", file=sys.stderr)
        return 2
    if cfg.prebuild:
        if not is_x86():
            if cfg.prebuild == ("all",):  # a multi-arch image build: nothing to make here
                print(f"pdserve kernels: no x86 ISA levels on {platform.machine()}; "
                      "nodes build natively or run the torch ops")
                return 0
            print(f"pdserve kernels: --prebuild {' '.join(cfg.prebuild)}: x86 levels, and "
                  f"this machine is {platform.machine()}", file=sys.stderr)
            return 2
        levels = parse_levels(cfg.prebuild)
        built = prebuilt.build(levels, SOURCES, sources_hash(),
                               compiler().decode(errors="replace"), Path(cfg.into),
                               cfg.verbose)
        for so in built:
            print(f"pdserve kernels: built {so}")
        return 0
    if load_cpu_ops(verbose=cfg.verbose) is None:
        print(f"pdserve kernels: not built ({build_error()})", file=sys.stderr)
        return 1
    print(f"pdserve kernels: ready ({build_id()})")
    return 0


sys.exit(main())
