"""The fused CPU kernels (pdserve/kernels/cpu_ops.cpp) against the torch reference ops, op by
op, on random inputs; and the engine choosing them (`--kernels`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.models.llama import _gathered_extend
from pdserve.models.ops import TorchOps, choose_ops

REF = TorchOps()


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    # float32: reduction order only; bfloat16: one rounding step of the storage dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_norms_match_reference(native, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    close(native.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5), dtype)
    res_a = torch.randn(rows, 576, generator=g).to(dtype)
    res_b = res_a.clone()
    out_a = native.add_rms_norm(x, res_a, w, 1e-5)
    out_b = REF.add_rms_norm(x, res_b, w, 1e-5)
    assert torch.equal(res_a, res_b)  # the residual add rounds exactly like torch's
    close(out_a, out_b, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [1536, 37])  # 16-lane loop, and a scalar tail
def test_silu_and_mul_matches_reference(native, dtype, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = (4 * torch.randn(9, 2 * inter, generator=g)).to(dtype)
    out, ref = native.silu_and_mul(gate_up), REF.silu_and_mul(gate_up)
    if dtype == torch.bfloat16:  # the exp's last-ulp differences vanish in the rounding
        assert torch.equal(out, ref)
    close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_store_matches_reference(native, dtype):
    g = torch.Generator().manual_seed(1)
    t, h, hkv, d = 11, 6, 2, 32
    qkv = torch.randn(t, h + 2 * hkv, d, generator=g).to(dtype)
    cos = torch.randn(t, d, generator=g).to(dtype)
    sin = torch.randn(t, d, generator=g).to(dtype)
    slots = torch.randperm(40, generator=g)[:t]
    bufs = [torch.zeros(40, hkv, d, dtype=dtype) for _ in range(4)]
    args = (cos, sin)
    q_ref, k_ref, v_ref = REF.rope_and_store(qkv.clone(), *args, *bufs[:2], slots, h, hkv)
    q_nat, k_nat, v_nat = native.rope_and_store(qkv.clone(), *args, *bufs[2:], slots, h, hkv)
    assert torch.equal(q_nat, q_ref)  # element-wise: same roundings, same bits
    assert torch.equal(k_nat, k_ref) and torch.equal(v_nat, v_ref)
    assert torch.equal(bufs[2], bufs[0]) and torch.equal(bufs[3], bufs[1])


def _decode_case(b: int, h: int, hkv: int, d: int, lens: list[int], dtype, ps: int = 4):
    g = torch.Generator().manual_seed(b * 100 + h)
    pages = max(-(-n // ps) for n in lens)
    total = b * pages + 3
    k_buf = torch.randn(total * ps, hkv, d, generator=g).to(dtype)
    v_buf = torch.randn(total * ps, hkv, d, generator=g).to(dtype)
    table = torch.randperm(total, generator=g)[: b * pages].view(b, pages)
    q = torch.randn(b, h, d, generator=g).to(dtype)
    return q, k_buf, v_buf, table, torch.tensor(lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 1, 128), (4, 2, 16)])
def test_decode_attention_matches_gathered_sdpa(native, dtype, h, hkv, d):
    lens = [1, 5, 17, 33, 8]  # one token, partial pages, full pages, rows of unequal length
    q, k_buf, v_buf, table, seq = _decode_case(len(lens), h, hkv, d, lens, dtype)
    # the torch path of a one-token prompt row over its cached context
    ref = _gathered_extend(q, k_buf, v_buf, table, tuple(n - 1 for n in lens),
                           (1,) * len(lens), 4, d**-0.5)
    out = native.decode_attention(q, k_buf, v_buf, table, seq, 4, d**-0.5)
    close(out.reshape(len(lens), h * d), ref, dtype)


def test_decode_attention_refuses_unsupported_shapes(native):
    assert not native.paged_decode(8, 8, 72)  # head_dim not a multiple of 16
    assert not native.paged_decode(64, 2, 64)  # 32 query heads share one KV head
    assert native.paged_decode(9, 3, 64) and not REF.paged_decode(9, 3, 64)
    q, k_buf, v_buf, table, seq = _decode_case(2, 4, 4, 24, [3, 4], torch.float32)
    with pytest.raises(RuntimeError, match="head_dim"):
        native.decode_attention(q, k_buf, v_buf, table, seq, 4, 0.2)


def test_choose_ops():
    assert choose_ops("torch", torch.device("cpu")).kind == "torch"
    assert choose_ops("auto", torch.device("cpu")).kind == "native"
    assert choose_ops("auto", torch.device("cuda")).kind == "torch"
    with pytest.raises(ValueError, match="CPU only"):
        choose_ops("native", torch.device("cuda"))
    with pytest.raises(ValueError, match="kernels must be"):
        choose_ops("fast", torch.device("cpu"))


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_small_linear_matches_torch(native, rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    w = torch.randn(200, 96, generator=g).to(torch.bfloat16)
    b = torch.randn(200, generator=g).to(torch.bfloat16) if bias else None
    out = native.m.small_linear(x, w, b)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    # float accumulation of exact bf16 products, one rounding to bf16 at the end
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)
    assert native.linear(x[:1], w, b).shape == (1, 200)
    with pytest.raises(RuntimeError, match="small_linear"):
        native.m.small_linear(x.float(), w.float(), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_torch(native, dtype, rows, bias):
    """Linears use the weight packed once for oneDNN where it runs the dtype (float32
    always, bfloat16 on CPUs with native bf16): the same products as F.linear up to
    summation order; one packed copy per weight, reused; other dtypes are not packed."""
    g = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = torch.nn.Parameter(torch.randn(200, 96, generator=g).to(dtype))  # as the model has it
    b = torch.randn(200, generator=g).to(dtype) if bias else None
    with torch.inference_mode():
        out = native.linear(x, w, b)
    close(out, torch.nn.functional.linear(x, w.detach(), b), dtype)
    packed = native.packed.get(w)
    assert float32_or_native_bf16(native, dtype) == (packed is not None)
    assert packed is native.packed.get(w)
    assert native.packed.get(w.detach().half()) is None


def float32_or_native_bf16(native, dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16
                                      and torch.ops.mkldnn._is_mkldnn_bf16_supported())




def test_kernel_cache_is_per_cpu_compiler_python_not_per_checkout(monkeypatch, tmp_path):
    """Two CPU kinds (-march=native), two compilers or two Pythons must not share a build
    folder; two checkouts of the same sources do (the folder holds only the finished .so)."""
    import pdserve.kernels as k

    here = k.cache_dir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert k.cache_dir().parent == tmp_path / "pdserve" / "kernels"
    assert k.cache_dir().name == here.name
    monkeypatch.setattr(k, "HERE", tmp_path)  # another checkout of the same sources
    assert k.cache_dir().name == here.name
    monkeypatch.setattr(k, "_cpu_flags", lambda: b"flags: avx2")
    avx2 = k.cache_dir().name
    assert avx2 != here.name
    assert k.compiler()  # e.g. b"c++ (Debian 12.2.0-14) 12.2.0"
    monkeypatch.setattr(k, "compiler", lambda: b"c++ (another) 99.0")
    other_cxx = k.cache_dir().name
    assert other_cxx not in (here.name, avx2)
    monkeypatch.setattr(k, "_python_abi", lambda: b".cpython-312-x86_64-linux-gnu.so")
    assert k.cache_dir().name not in (here.name, avx2, other_cxx)


LOAD_WITHOUT_JIT = """
import json, torch.utils.cpp_extension as jit
def refuse(*a, **kw):
    raise AssertionError("the JIT loader ran")
jit.load = refuse
import pdserve.kernels as k
m = k.load_cpu_ops()
assert m is not None, k.build_error()
assert k.build_id() == k.cache_dir().name and m.__file__.startswith(str(k.cache_dir())), m
print(json.dumps(sorted(p.name for p in k.cache_dir().iterdir())))
"""


def test_a_made_build_loads_without_the_jit_loader(native):
    """Once made, the native build is imported from its .so: a node process does not pay
    torch's JIT loader (ninja asked whether it is up to date, most of a second) at start.
    The build folder holds that .so alone (no build.ninja or lock for another checkout)."""
    import json
    import subprocess
    import sys

    import pdserve.kernels as k

    if k.build_id() is None or k.build_id().startswith("prebuilt-"):
        pytest.fail(f"expected a native build on the test machine, got {k.build_id()}")
    run = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_JIT], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    files = json.loads(run.stdout.strip().splitlines()[-1])
    assert [f for f in files if not f.startswith(".build-")] == [
        f"pdserve_cpu_ops_{k.cache_dir().name}.so"], files


def test_a_build_is_published_by_rename_and_clears_killed_builds(monkeypatch, tmp_path):
    """The build runs in a private folder and only its .so is published (the compiler is
    replaced here by a stand-in that writes the .so: the real one takes minutes); a private
    folder a killed build left an hour ago is removed, a running build's is not."""
    import os
    import time

    import torch.utils.cpp_extension as jit

    import pdserve.kernels as k

    build = tmp_path / "key"
    build.mkdir()
    killed, running = build / ".build-killed", build / ".build-running"
    killed.mkdir()
    running.mkdir()
    old = time.time() - k.STALE_BUILD_S - 60
    os.utime(killed, (old, old))
    seen = {}

    def compile_here(name, sources, build_directory, **_):
        seen["dir"] = build_directory
        (Path(build_directory) / f"{name}.so").write_bytes(b"built")
        return "the module"

    monkeypatch.setattr(jit, "load", compile_here)
    so = build / "pdserve_cpu_ops_key.so"
    assert k._build_native(build, "pdserve_cpu_ops_key", so, verbose=False) == "the module"
    assert Path(seen["dir"]).parent == build and not Path(seen["dir"]).exists()
    assert so.read_bytes() == b"built"
    assert sorted(p.name for p in build.iterdir()) == [".build-running", so.name]
