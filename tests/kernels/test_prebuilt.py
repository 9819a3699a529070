"""Kernel builds made ahead of time (pdserve/kernels/prebuilt.py, isa.py): which ISA level a
CPU runs, which build a node loads, and (slow) real builds per level that load and compute
what the torch reference ops compute."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.kernels import prebuilt, sources_hash
from pdserve.kernels.isa import BY_NAME, LEVELS, cpu_flags, is_x86, parse_levels, pick

AVX2_EPYC = BY_NAME["avx2"].needs | {"sse4_2", "avx_vnni"}          # Zen 2/3, no AVX-512
SKYLAKE_X = BY_NAME["avx512"].needs | {"avx512_vnni"}
ZEN4 = BY_NAME["avx512_bf16"].needs | {"avx512_vnni"}               # AVX512-BF16, no AMX
SAPPHIRE_RAPIDS = BY_NAME["avx512_bf16"].needs | {"amx_tile", "amx_bf16", "amx_int8"}
ALL = [lv.name for lv in LEVELS]


@pytest.mark.parametrize(("flags", "want"), [
    (AVX2_EPYC, "avx2"), (SKYLAKE_X, "avx512"), (ZEN4, "avx512_bf16"),
    (SAPPHIRE_RAPIDS, "amx"),
    (frozenset({"sse4_2", "avx"}), None),   # an older x86: no level, a native build instead
    (frozenset(), None),                    # no /proc/cpuinfo flags (another architecture)
])
def test_the_highest_level_the_cpu_runs_is_picked(flags, want):
    got = pick(flags, ALL)
    assert (got.name if got else None) == want


def test_only_levels_that_were_built_are_picked():
    assert pick(SAPPHIRE_RAPIDS, ["avx2", "avx512"]).name == "avx512"
    assert pick(SAPPHIRE_RAPIDS, ["avx512_bf16"]).name == "avx512_bf16"
    assert pick(ZEN4, ["avx512_bf16", "amx"]).name == "avx512_bf16"
    assert pick(AVX2_EPYC, ["avx512", "avx512_bf16"]) is None


def test_only_x86_machines_have_levels():
    assert is_x86("x86_64") and is_x86("AMD64")
    assert not is_x86("aarch64") and not is_x86("arm64")


def test_levels_are_named_or_all():
    assert parse_levels(("all",)) == LEVELS
    assert [lv.name for lv in parse_levels(("avx512_bf16", "avx2"))] == ["avx2", "avx512_bf16"]
    with pytest.raises(ValueError, match="known: avx2, avx512, avx512_bf16, amx or all"):
        parse_levels(("avx3",))


def test_cpu_flags_read_the_first_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 fma\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(info) == {"fpu", "avx2", "fma"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


def fake_build(root: Path, level: str, *, sources: str, torch_version: str = torch.__version__,
               with_so: bool = True, flags: list[str] | None = None) -> None:
    """A build folder as prebuilt.build leaves it (the .so's content is never read here)."""
    out = root / level
    out.mkdir(parents=True)
    module = f"pdserve_cpu_ops_{level}"
    cflags = [*prebuilt.CFLAGS, *BY_NAME[level].cflags] if level in BY_NAME else []
    (out / "manifest.json").write_text(json.dumps(
        {"level": level, "module": module, "sources": sources, "torch": torch_version,
         "cflags": cflags if flags is None else flags}))
    if with_so:
        (out / f"{module}.so").write_bytes(b"")


def test_a_node_loads_the_highest_fresh_build_its_cpu_runs(tmp_path):
    src = sources_hash()
    fake_build(tmp_path, "avx2", sources=src)
    fake_build(tmp_path, "avx512", sources=src)
    fake_build(tmp_path, "avx512_bf16", sources=src)
    pre = prebuilt.usable(src, tmp_path, flags=SKYLAKE_X)
    assert pre is not None and pre.level == "avx512"
    assert pre.path == tmp_path / "avx512" / "pdserve_cpu_ops_avx512.so"
    assert pre.build_id == f"prebuilt-avx512-{src[:12]}"
    assert prebuilt.usable(src, tmp_path, flags=frozenset({"sse2"})) is None


def test_stale_foreign_or_incomplete_builds_are_skipped(tmp_path, caplog):
    src = sources_hash()
    fake_build(tmp_path, "avx2", sources=src)
    fake_build(tmp_path, "avx512", sources="0" * 64)                    # older sources
    fake_build(tmp_path, "avx512_bf16", sources=src, torch_version="2.0.0")  # other torch
    pre = prebuilt.usable(src, tmp_path, flags=SAPPHIRE_RAPIDS)
    assert pre is not None and pre.level == "avx2"
    assert "built from other sources or torch 2.0.0" in caplog.text
    other = tmp_path / "other"
    fake_build(other, "avx2", sources=src, flags=["-O3", "-march=native"])  # not the level's
    fake_build(other, "avx512", sources=src)
    assert prebuilt.usable(src, other, flags=AVX2_EPYC) is None
    assert "skipped: built with flags" in caplog.text
    (tmp_path / "avx2" / "pdserve_cpu_ops_avx2.so").unlink()              # manifest, no .so
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{not json")
    assert prebuilt.usable(src, tmp_path, flags=SAPPHIRE_RAPIDS) is None
    assert prebuilt.usable(src, tmp_path / "nothing-here") is None


def test_the_cli_refuses_an_unknown_level():
    out = subprocess.run([sys.executable, "-m", "pdserve.kernels", "--prebuild", "avx3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "unknown ISA level avx3" in out.stderr


CHECK = """
import sys, torch
from pathlib import Path
from pdserve.kernels import prebuilt, sources_hash
from pdserve.models.ops import NativeOps, TorchOps
pre = prebuilt.usable(sources_hash(), Path(sys.argv[1]))
assert pre is not None and pre.level == sys.argv[2], pre
ops, ref = NativeOps(prebuilt.load(pre)), TorchOps()
g = torch.Generator().manual_seed(0)
x = torch.randn(5, 576, generator=g).to(torch.bfloat16)
w = torch.randn(576, generator=g).to(torch.bfloat16)
torch.testing.assert_close(ops.rms_norm(x, w, 1e-5).float(), ref.rms_norm(x, w, 1e-5).float(),
                           atol=2e-2, rtol=2e-2)
lin = torch.randn(64, 576, generator=g).to(torch.bfloat16)
torch.testing.assert_close(ops.linear(x[:1], lin, None).float(),
                           ref.linear(x[:1], lin, None).float(), atol=5e-2, rtol=2e-2)
print("ok", pre.build_id)
"""


@pytest.mark.slow
def test_real_builds_per_level_load_and_match_the_reference(tmp_path):
    """Compiles the lowest level and the highest this CPU runs (~80 s each on 2 cores), then
    a fresh process loads the picked one and checks two ops against torch."""
    mine = pick(cpu_flags(), ALL)
    if mine is None:
        pytest.fail("this test needs an x86 CPU with AVX2")
    names = sorted({"avx2", mine.name}, key=ALL.index)
    built = subprocess.run([sys.executable, "-m", "pdserve.kernels", "--prebuild", *names,
                            "--into", str(tmp_path)], capture_output=True, text=True,
                           timeout=900)
    assert built.returncode == 0, built.stderr[-2000:]
    for name in names:
        assert (tmp_path / name / f"pdserve_cpu_ops_{name}.so").is_file()
    run = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path), mine.name],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith(f"ok prebuilt-{mine.name}-")
