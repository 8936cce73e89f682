"""The ``sage-sm90`` route without a GPU: its contract with the CUDA source, the V^T key order its quantizer
writes, the build (by nvcc where it is here, else NVRTC), the compile cache, and the reasons it gives where it
cannot run."""

from __future__ import annotations

import ctypes
import os
import re
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import sass_hazards
from background_jobs import BackgroundJob
from triton_support import interpreter_missing
from diffusers_trtllm.config import QuantConfig
from diffusers_trtllm.kernels import cuda_jit, sage_sm90
from diffusers_trtllm.kernels.triton_quant import mma_key_column
from diffusers_trtllm.layout import PackedLayout
from diffusers_trtllm.routing import AttentionCall, NoRouteError, select_route
from diffusers_trtllm.routing.policy import apply_policy

SOURCE = cuda_jit.source_path("sage_sm90.cu")
ROOT = Path(__file__).resolve().parents[1]


def _c_struct_fields(name: str) -> list[str]:
    body = re.search(r"struct %s \{(.*?)\};" % name, SOURCE.read_text(), re.S).group(1)
    return re.findall(r"\b(\w+);", re.sub(r"//[^\n]*", "", body))


def test_params_match_the_cuda_struct_field_for_field():
    assert [f[0] for f in sage_sm90._Params._fields_] == _c_struct_fields("Params")
    assert ctypes.sizeof(sage_sm90._Params) == 136


def test_persistent_default_is_the_sources_and_defines_override_it():
    default = re.search(r"#define SAGE_SM90_PERSISTENT (\d)", SOURCE.read_text()).group(1)
    assert sage_sm90.PERSISTENT == bool(int(default)) == sage_sm90._persistent(())
    assert not sage_sm90._persistent(("SAGE_SM90_STAGES=3", "SAGE_SM90_PERSISTENT=0"))
    assert sage_sm90._persistent(("SAGE_SM90_PERSISTENT=0", "SAGE_SM90_PERSISTENT=1"))
    assert sage_sm90._persistent(("SAGE_SM90_PERSISTENT",)) and not sage_sm90._persistent(("SAGE_SM90_PINGPONG=1",))


def test_consumers_default_is_the_sources_and_sets_the_ctas_rows_and_threads():
    """Two consumer warpgroups: CTAs of 128 query rows and 384 threads, one an SM; one consumer: 64 rows, 256 threads,
    two an SM (the source's __launch_bounds__ and shared memory fit them); the knob as the compiler reads it."""
    default = re.search(r"#define SAGE_SM90_CONSUMERS (\d)", SOURCE.read_text()).group(1)
    assert sage_sm90.CONSUMERS == int(default)
    assert sage_sm90._cta(()) == sage_sm90._Cta(rows=128, threads=384, per_sm=1, persistent=False)
    assert sage_sm90._cta(("SAGE_SM90_STAGES=3", "SAGE_SM90_CONSUMERS=2")) == sage_sm90._cta(())
    assert sage_sm90._cta(("SAGE_SM90_CONSUMERS=1",)) == (64, 256, 2, False)
    assert sage_sm90._cta(("SAGE_SM90_CONSUMERS=1", "SAGE_SM90_PERSISTENT=1")) == (64, 256, 2, True)
    assert sage_sm90._cta(("SAGE_SM90_CONSUMERS=1", "SAGE_SM90_CONSUMERS=2")).rows == 128  # the last wins
    assert sage_sm90._cta(("SAGE_SM90_CONSUMERS",)).rows == 64  # a bare name is 1
    with pytest.raises(ValueError, match="SAGE_SM90_CONSUMERS is 1 or 2; got 3"):
        sage_sm90._cta(("SAGE_SM90_CONSUMERS=3",))


def _ragged_layout() -> PackedLayout:
    """Five sequences: no queries nor keys, one token, 300 queries over 200 keys, keys without queries, 129 queries."""
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    lens_q, lens_kv = (0, 1, 300, 0, 129), (0, 1, 200, 50, 140)
    return PackedLayout.from_cu_seqlens(cu(lens_q), cu(lens_kv), 300, 200, q_tokens=sum(lens_q), kv_tokens=sum(lens_kv))


def test_persistent_grid_is_one_cta_per_sm_up_to_the_work_tiles(monkeypatch):
    """One CTA per SM while there are more work tiles (128 query rows of one sequence and head); fewer where there
    are fewer, a sequence without queries or keys counting none; one CTA per work tile without the knob."""
    monkeypatch.setattr(sage_sm90, "_sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)
    persistent, per_tile = sage_sm90._cta(("SAGE_SM90_PERSISTENT=1",)), sage_sm90._cta(())
    flux = PackedLayout.dense(1, 4608, 4608, "cpu")
    assert sage_sm90._grid(flux, 24, persistent, dev) == (132, 1, 1)  # 864 work tiles
    assert sage_sm90._grid(flux, 24, per_tile, dev) == (36, 24, 1)
    assert sage_sm90._grid(_ragged_layout(), 8, persistent, dev) == (8 * (1 + 3 + 2), 1, 1)
    assert sage_sm90._grid(_ragged_layout(), 8, per_tile, dev) == (3, 5 * 8, 1)


def test_one_consumer_grid_counts_tiles_of_64_rows_two_ctas_an_sm(monkeypatch):
    """CTAs of one consumer: twice the query tiles, and the persistent kernel two CTAs an SM up to the work tiles."""
    monkeypatch.setattr(sage_sm90, "_sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)
    persistent = sage_sm90._cta(("SAGE_SM90_CONSUMERS=1", "SAGE_SM90_PERSISTENT=1"))
    per_tile = sage_sm90._cta(("SAGE_SM90_CONSUMERS=1",))
    flux = PackedLayout.dense(1, 4608, 4608, "cpu")
    assert sage_sm90._grid(flux, 24, persistent, dev) == (264, 1, 1)  # 1,728 work tiles
    assert sage_sm90._grid(flux, 24, per_tile, dev) == (72, 24, 1)
    assert sage_sm90._grid(_ragged_layout(), 8, persistent, dev) == (8 * (1 + 5 + 3), 1, 1)
    assert sage_sm90._grid(_ragged_layout(), 8, per_tile, dev) == (5, 5 * 8, 1)


def test_every_entry_point_the_host_names_is_defined():
    text = SOURCE.read_text()
    body = re.search(r"#define SAGE_SM90_KERNELS\(D, DT\)(.*?)\n(?=SAGE_SM90_KERNELS\()", text, re.S).group(1)
    entries = re.findall(r"SAGE_SM90_ENTRY\(D, DT, (\d+), ([01])\)", body)
    instances = re.findall(r"^SAGE_SM90_KERNELS\((\d+), (\w+)\)", text, re.M)
    defined = {f"sage_sm90_d{d}_{dt}_k{kb}" + ("_skip" if skip == "1" else "") for d, dt in instances for kb, skip in entries}
    assert len(defined) == 32 and set(sage_sm90.KERNEL_NAMES) == defined


def test_a_variant_selects_its_one_entry_point_by_defines():
    variant = sage_sm90.Variant(64, torch.float16, 4, True)
    assert variant.name == "sage_sm90_d64_fp16_k4_skip" == sage_sm90.kernel_name(64, torch.float16, 4, True)
    assert variant.defines == ("SAGE_SM90_HEAD_DIM=64", "SAGE_SM90_OUT=fp16", "SAGE_SM90_K_BLOCK=4", "SAGE_SM90_SKIP=1")
    assert len(set(sage_sm90.VARIANTS)) == 32


def test_the_source_includes_no_header():
    """NVRTC has no C or C++ standard headers (``#include <stdint.h>`` stopped it): the source needs none."""
    assert not re.findall(r"^\s*#\s*include", SOURCE.read_text(), re.M)


def test_key_order_is_the_mma_fragment_order():
    """Position 4t + 2h + e of every aligned group of 16 holds key 8h + 2t + e: a bijection within each group."""
    cols = torch.arange(64)
    pos = mma_key_column.fn(cols)
    assert sorted(pos.tolist()) == list(range(64))
    assert ((pos // 16) == (cols // 16)).all()
    for t in range(4):
        for h in range(2):
            for e in range(2):
                assert int(pos[8 * h + 2 * t + e]) == 4 * t + 2 * h + e


_ROUND_TRIP = """
import torch
import triton_interpreter
from diffusers_trtllm.config import QuantConfig
from diffusers_trtllm.kernels.triton_quant import sage_quantize_triton
from diffusers_trtllm.layout import PackedLayout
triton_interpreter.vectorize_reductions()
# (V's layout depends on the lengths only; each K block size and smooth_k still run once, Q and K compared too)
for lens, k_block, smooth_k in [((1,), 1, False), ((37, 70), 4, True), ((16, 90, 5), 16, False), ((16, 90, 5), 1, True),
                               ((130, 70), 128, True)]:
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    layout = PackedLayout.from_cu_seqlens(cu, cu, max(lens), max(lens), q_tokens=sum(lens), kv_tokens=sum(lens))
    gen = torch.Generator().manual_seed(sum(lens))
    q, k, v = (torch.randn(sum(lens), 2, 64, generator=gen) for _ in range(3))
    quant = QuantConfig("int8", 1, k_block, smooth_k=smooth_k)
    natural = sage_quantize_triton(q, k, v, layout, quant)
    permuted = sage_quantize_triton(q, k, v, layout, quant, mma_key_order=True)
    assert torch.equal(natural.v(layout), permuted.v(layout)), (lens, k_block)
    assert torch.equal(natural.q.float(), permuted.q.float()) and torch.equal(natural.k.float(), permuted.k.float())
    # The gaps between sequences are zero in both (the kernel's last tile reads them with P = 0).
    assert torch.equal(natural.vt.abs().sum(), permuted.vt.abs().sum()), (lens, k_block)
print("ok")
"""


#: The round trip's child, started with the session (``background_jobs``).
ROUND_TRIP = BackgroundJob(
    lambda workdir: None if interpreter_missing() else [sys.executable, "-c", _ROUND_TRIP],
    ("test_quantized_v_reads_back_the_same_in_either_key_order",),
    env=dict(os.environ, TRITON_INTERPRET="1",
             PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])))


def test_quantized_v_reads_back_the_same_in_either_key_order():
    """Under Triton's interpreter (set before triton is imported, so in a child process): V^T in the kernel's
    key order holds the same values as in natural order (Q and K unchanged by it), over ragged batches."""
    if interpreter_missing():
        pytest.skip(interpreter_missing())
    run = ROUND_TRIP.result(timeout=300)  # 7 s on an idle 2-core machine, 14 s with the other core busy
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def _call(device="cpu", quant="int8", dim=128):
    layout = PackedLayout.dense(1, 256, 256, device)
    q = torch.zeros(256, 2, dim, dtype=torch.bfloat16)
    return AttentionCall(q, q, q, layout, dim**-0.5, quant=QuantConfig(quant) if quant else None)


def test_reasons_name_what_is_missing(monkeypatch):
    route = sage_sm90.SageSm90Route()
    assert any("cuda" in r for r in route.not_supported_reasons(_call()))
    assert any("int8 SAGE only" in r for r in route.not_supported_reasons(_call(quant=None)))
    assert any("dtype_qk=fp8_e4m3" in r for r in route.not_supported_reasons(_call(quant="fp8_e4m3")))
    assert any("head dim 96" in r for r in route.not_supported_reasons(_call(dim=96)))
    ring_shard = replace(_call(), return_lse=True, kv_shards=2)
    assert route.caps.lse and not any("log-sum-exp" in r for r in route.not_supported_reasons(ring_shard))
    monkeypatch.setattr(cuda_jit, "find_compiler", lambda: None)
    assert any("needs NVRTC or nvcc" in r and "pip install nvidia-cuda-nvrtc" in r and "DIFFUSERS_TRTLLM_NVCC" in r
               for r in route.not_supported_reasons(_call()))
    with pytest.raises(NoRouteError, match="sage-sm90: .*needs NVRTC or nvcc"):
        select_route(_call(), "sage-sm90")


def test_ring_shards_run_int8_sage_here_where_it_ranks_first(monkeypatch):
    """A ring KV shard (``return_lse``) of int8 SAGE, with or without skip, on a faked H200 with long keys: this
    kernel, as on one GPU, whether the call is taken as asked or after the policy."""
    from test_route_table import fake_environment, make_call

    fake_environment(monkeypatch, "sm90", "yes")
    for skip in ("none", "skip"):
        ring_shard = make_call("sm90", "bf16", 128, "self-75600", skip, "int8", "ring2")
        assert ring_shard.return_lse and ring_shard.kv_shards == 2
        assert select_route(ring_shard).name == select_route(apply_policy(ring_shard).call).name == "sage-sm90"


def test_k_scales_per_thread_are_this_kernels_and_the_references():
    from diffusers_trtllm.kernels.reference import ReferenceRoute
    from diffusers_trtllm.kernels.triton_attn import TritonRoute

    call = _call(quant=None)
    call = AttentionCall(call.q, call.k, call.v, call.layout, call.softmax_scale,
                         quant=QuantConfig("int8", k_per_thread=True))
    assert any("no K scales per thread" in r for r in TritonRoute().not_supported_reasons(call))
    for route in (sage_sm90.SageSm90Route(), ReferenceRoute()):
        assert not any("per thread" in r for r in route.not_supported_reasons(call))


def test_host_function_refuses_what_the_kernel_cannot_run():
    call = _call()
    with pytest.raises(ValueError, match="Hopper"):
        sage_sm90.sage_sm90_attention(call.q, call.k, call.v, call.layout, softmax_scale=0.1, quant=QuantConfig("int8"))


def test_k_block_left_to_the_route_is_128_here_and_16_on_the_triton_route(monkeypatch):
    """``quant="int8"`` without ``k_block_size``: this kernel quantizes K by KV tile (its faster block), split
    per thread as ``K_PER_THREAD`` says, the triton route and the reference by FlashInfer's 16; a block the
    user gives is kept."""
    from diffusers_trtllm.kernels import triton_quant
    from diffusers_trtllm.kernels.reference import sage_quantize
    from diffusers_trtllm.kernels.triton_attn import triton_attention

    class Quantized(Exception):
        pass

    seen = []

    def quantize(q, k, v, layout, quant, mma_key_order=False):
        seen.append((mma_key_order, quant.k_block_size, quant.k_per_thread))
        raise Quantized

    monkeypatch.setattr(triton_quant, "sage_quantize_triton", quantize)
    monkeypatch.setattr(sage_sm90, "_check_call", lambda q, k, quant: None)
    call = _call()
    for quant in (QuantConfig("int8"), QuantConfig("int8", 1, 4), QuantConfig("int8", 1, 16)):
        for run in (sage_sm90.sage_sm90_attention, triton_attention):
            with pytest.raises(Quantized):
                run(call.q, call.k, call.v, call.layout, softmax_scale=0.1, quant=quant)
    split = sage_sm90.K_PER_THREAD
    assert seen == [(True, 128, split), (False, 16, False), (True, 4, False), (False, 4, False), (True, 16, split),
                    (False, 16, False)]
    ref = sage_quantize(call.q, call.k, call.v, call.layout.cu_seqlens_q, call.layout.cu_seqlens_kv, (256,), (256,),
                        QuantConfig("int8"))
    assert ref.k_scale.shape == (2, 256 // 16)
    with pytest.raises(ValueError, match="one K scale per block; quant.k_per_thread=True is the sage-sm90"):
        triton_attention(call.q, call.k, call.v, call.layout, softmax_scale=0.1,
                         quant=QuantConfig("int8", k_per_thread=True))


def test_compile_is_cached_by_source_flags_and_compiler(tmp_path, monkeypatch):
    """A stand-in nvcc: the first build runs it, the same build again does not, other flags build anew."""
    log = tmp_path / "calls"
    fake = tmp_path / "nvcc"
    fake.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 99.9"; exit 0; fi
echo "$@" >> {log}
while [ "$#" -gt 0 ]; do if [ "$1" = "-o" ]; then echo cubin > "$2"; fi; shift; done
""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("DIFFUSERS_TRTLLM_NVCC", str(fake))
    monkeypatch.setenv("DIFFUSERS_TRTLLM_CACHE", str(tmp_path / "cache"))
    first = cuda_jit.compile_cubin(SOURCE, "90a")
    again = cuda_jit.compile_cubin(SOURCE, "90a")
    other = cuda_jit.compile_cubin(SOURCE, "90a", ("SAGE_SM90_STAGES=2",))
    assert first == again != other and first.read_text() == "cubin\n"
    assert len(log.read_text().splitlines()) == 2
    assert "-DSAGE_SM90_STAGES=2" in log.read_text().splitlines()[1]


def test_compile_error_says_which_file_and_why(tmp_path, monkeypatch):
    fake = tmp_path / "nvcc"
    fake.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo v; exit 0; fi\necho "error: boom" >&2; exit 1\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("DIFFUSERS_TRTLLM_NVCC", str(fake))
    monkeypatch.setenv("DIFFUSERS_TRTLLM_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="nvcc failed to build sage_sm90.cu for sm_90a:\nerror: boom"):
        cuda_jit.compile_cubin(SOURCE, "90a")


def _clear_compiler_caches():
    for fn in (cuda_jit._find_nvcc, cuda_jit._find_nvrtc, cuda_jit._named_nvcc):
        fn.cache_clear()


def test_nvrtc_is_found_where_torchs_cuda_wheels_put_it(tmp_path, monkeypatch):
    """``nvidia-cuda-nvrtc``'s layout on sys.path (CUDA 13: ``nvidia/cu13/lib``; CUDA 12: ``nvidia/cuda_nvrtc/lib``)
    is found for torch's CUDA major version, ahead of the dynamic loader; $DIFFUSERS_TRTLLM_NVRTC wins."""
    for major, sub in ((13, "cu13"), (12, "cuda_nvrtc")):
        lib = tmp_path / f"site{major}" / "nvidia" / sub / "lib" / f"libnvrtc.so.{major}"
        lib.parent.mkdir(parents=True)
        lib.write_bytes(b"")
        monkeypatch.setattr(cuda_jit, "_cuda_majors", lambda major=major: (major,))
        monkeypatch.setattr(sys, "path", [str(tmp_path / "elsewhere"), str(tmp_path / f"site{major}")])
        _clear_compiler_caches()
        assert cuda_jit.find_nvrtc() == str(lib)
    monkeypatch.setenv("DIFFUSERS_TRTLLM_NVRTC", str(lib))
    _clear_compiler_caches()
    assert cuda_jit.find_nvrtc() == str(lib)
    monkeypatch.setenv("DIFFUSERS_TRTLLM_NVRTC", str(tmp_path / "missing.so"))
    _clear_compiler_caches()
    assert cuda_jit.find_nvrtc() is None
    _clear_compiler_caches()


def test_compiler_order_nvcc_when_named_else_nvrtc_else_nvcc(tmp_path, monkeypatch):
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    nvrtc = object()
    monkeypatch.setattr(cuda_jit, "_nvrtc", lambda path: nvrtc)
    monkeypatch.setattr(cuda_jit, "find_nvrtc", lambda: "libnvrtc.so.13")
    monkeypatch.delenv("DIFFUSERS_TRTLLM_NVCC", raising=False)
    assert cuda_jit.find_compiler() is nvrtc
    monkeypatch.setenv("DIFFUSERS_TRTLLM_NVCC", str(fake))
    assert cuda_jit.find_compiler() == cuda_jit.Nvcc(str(fake))
    monkeypatch.setenv("DIFFUSERS_TRTLLM_NVCC", str(tmp_path / "no-nvcc"))
    _clear_compiler_caches()
    assert cuda_jit.find_compiler() is None
    assert "DIFFUSERS_TRTLLM_NVCC=" in cuda_jit.compiler_missing() and "not an executable nvcc" in cuda_jit.compiler_missing()
    monkeypatch.delenv("DIFFUSERS_TRTLLM_NVCC")
    monkeypatch.setattr(cuda_jit, "find_nvrtc", lambda: None)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    (tmp_path / "bin").mkdir()
    fake.rename(tmp_path / "bin" / "nvcc")
    _clear_compiler_caches()
    assert cuda_jit.find_compiler() == cuda_jit.Nvcc(str(tmp_path / "bin" / "nvcc"))
    _clear_compiler_caches()


@pytest.mark.skipif(cuda_jit.find_nvrtc() is None, reason="needs NVRTC (pip install nvidia-cuda-nvrtc)")
def test_one_variant_compiles_with_nvrtc_alone(tmp_path, monkeypatch):
    """No toolkit, no GPU: NVRTC builds one entry point of the source (and only that one) into a cubin, cached."""
    monkeypatch.setenv("DIFFUSERS_TRTLLM_CACHE", str(tmp_path))
    monkeypatch.delenv("DIFFUSERS_TRTLLM_NVCC", raising=False)
    compiler = cuda_jit.find_compiler()
    assert compiler.name == "nvrtc" and compiler.version.startswith("NVRTC ")
    variant = sage_sm90.Variant(128, torch.bfloat16, 128, True)
    cubin = sage_sm90.sage_sm90_cubin.__wrapped__(variant, (), compiler)
    data = cubin.read_bytes()
    assert data[:4] == b"\x7fELF" and b"sage_sm90_d128_bf16_k128_skip" in data
    assert b"sage_sm90_d128_bf16_k16" not in data and b"sage_sm90_d64_" not in data
    assert sage_sm90.sage_sm90_cubin.__wrapped__(variant, (), compiler) == cubin


def test_hazard_walk_ends_at_the_wait_that_retires_the_group():
    """sass_hazards counts the groups committed after a product: a wait that leaves one pending retires it once
    another group followed, not before; a write before that wait is a hazard, one after it is not."""
    def listing(*instructions):
        return [(16 * i, ins) for i, ins in enumerate(instructions)]

    sums = "QGMMA.64x8x32.F32.E4M3.E4M3 R152, R156, gdesc[UR16], R152, gsb0"
    later_group = "HGMMA.64x8x16.F16 RZ, gdesc[URZ], RZ, !UPT, gsb0"
    write = "FADD R153, R1, R2"
    partial_wait, full_wait = "WARPGROUP.DEPBAR.LE gsb0, 0x1", "WARPGROUP.DEPBAR.LE gsb0, 0x0"
    assert sass_hazards.in_flight_writes(listing(sums, later_group, partial_wait, write, full_wait)) == []
    assert sass_hazards.in_flight_writes(listing(sums, partial_wait, write, full_wait)) == ["0x20 FADD R153, R1, R2"]
    assert sass_hazards.in_flight_writes(listing(sums, write, later_group, partial_wait)) == ["0x10 FADD R153, R1, R2"]


#: Every entry point in one cubin by NVRTC, ptxas's report (NVRTC's log) on stderr: what users' machines build.
_NVRTC_REPORT_BUILD = """
import logging, sys
from pathlib import Path
from diffusers_trtllm._logging import logger
from diffusers_trtllm.kernels import cuda_jit
logger.setLevel(logging.DEBUG)
logger.addHandler(logging.StreamHandler(sys.stderr))
nvrtc = cuda_jit.Nvrtc(cuda_jit.find_nvrtc())
Path(sys.argv[1], "k.cubin").write_bytes(nvrtc.cubin(cuda_jit.source_path("sage_sm90.cu"), "90a", ()))
"""


def _ptxas_report_build(workdir):
    """nvcc where one is installed, else NVRTC (torch's CUDA wheels' compiler, in the test extras)."""
    nvcc = cuda_jit.find_nvcc()
    if nvcc is not None:
        return [nvcc, "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "-Xptxas=-v",
                "-o", str(workdir / "k.cubin"), str(SOURCE)]
    if cuda_jit.find_nvrtc() is not None:
        return [sys.executable, "-c", _NVRTC_REPORT_BUILD, str(workdir)]
    return None


#: The build with ptxas's report, started with the session (``background_jobs``): about 2 minutes of one core.
PTXAS_REPORT_BUILD = BackgroundJob(_ptxas_report_build,
                                   ("test_kernel_builds_for_sm90a_without_spills_or_serialized_products",))


@pytest.mark.skipif(cuda_jit.find_nvcc() is None and cuda_jit.find_nvrtc() is None, reason="needs nvcc or NVRTC")
def test_kernel_builds_for_sm90a_without_spills_or_serialized_products():
    """ptxas's report for the default K block sizes (16 and 4): no local memory, and no wgmma serialized
    (C7510-C7520 'Potential Performance Loss'), which would cost the kernel most of its speed; ptxas
    serializes the overlap's products as soon as the groups in flight differ between the paths into a
    wait. And in the SASS, no instruction
    writes a register of a P.V product that is still running (ptxas reused P's registers in the overlap
    build's next softmax before the copy that keeps them alive; only the GPU test caught it), and in every
    kernel, skip builds included, P.V still runs past the wait for Q.K^T (the overlap)."""
    res = PTXAS_REPORT_BUILD.result(timeout=600)  # about 75 s of one idle core, by nvcc or NVRTC
    assert res.returncode == 0, f"(None: killed at its timeout) {res.returncode}: {res.stderr}"
    assert "Potential Performance Loss" not in res.stderr
    # nvcc's report line is "    0 bytes stack frame, ...", NVRTC's "ptxas         .     0 bytes stack frame, ...".
    report = dict(re.findall(r"Compiling entry function '(\w+)'.*?\n[^\n]*?(\d+) bytes stack frame", res.stderr, re.S))
    assert set(report) == set(sage_sm90.KERNEL_NAMES)
    spilling = {name for name, frame in report.items() if int(frame) and "_k1" not in name}
    assert not spilling, f"local memory in {sorted(spilling)}"
    cuobjdump = sass_hazards.find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump to read the SASS with")
    sass = sass_hazards.cubin_sass(cuobjdump, res.workdir / "k.cubin")
    assert set(sass) == set(sage_sm90.KERNEL_NAMES)
    hazards = {name: found for name, code in sass.items() if (found := sass_hazards.in_flight_writes(code))}
    assert not hazards, f"registers of a running P.V product overwritten: {({k: v[:3] for k, v in hazards.items()})}"
    serial = sorted(name for name, code in sass.items() if not sass_hazards.pv_runs_past_a_partial_wait(code))
    assert not serial, f"no softmax overlap (P.V retired by the wait for Q.K^T) in {serial}"


@pytest.mark.skipif(cuda_jit.find_nvcc() is None, reason="needs nvcc (ptxas's report)")
@pytest.mark.parametrize("defines", [("SAGE_SM90_PERSISTENT=1",), ("SAGE_SM90_PERSISTENT=1", "SAGE_SM90_STAGES=6"),
                                     ("SAGE_SM90_PERSISTENT=1", "SAGE_SM90_OVERLAP=0"),
                                     ("SAGE_SM90_PERSISTENT=1", "SAGE_SM90_Q_BUFFERS=1"),
                                     ("SAGE_SM90_CONSUMERS=1",), ("SAGE_SM90_CONSUMERS=1", "SAGE_SM90_PERSISTENT=1"),
                                     ("SAGE_SM90_RESCALE_SLACK=2",)])
def test_other_builds_compile_without_spills(defines, tmp_path):
    """Builds beside the default the benchmark times: the persistent kernel alone, with six stages (one Q buffer:
    two do not fit beside them), with the serial build (no softmax overlap) and with one Q buffer; CTAs of one
    consumer (232 registers a thread where two have 240), alone and persistent; O's rescale with slack; two entry
    points each (the route's and a head dim 64 one), no local memory and no serialized products."""
    nvcc = cuda_jit.find_nvcc()
    for variant in (sage_sm90.Variant(128, torch.bfloat16, 128, True), sage_sm90.Variant(64, torch.float16, 16, False)):
        flags = [f"-D{d}" for d in (*variant.defines, *defines)]
        res = subprocess.run([nvcc, "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17",
                              "-Xptxas=-v", *flags, "-o", str(tmp_path / "k.cubin"), str(SOURCE)],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "Potential Performance Loss" not in res.stderr
        assert re.search(r"\b0 bytes stack frame", res.stderr), res.stderr[-2000:]


@pytest.mark.skipif(cuda_jit.find_nvcc() is None, reason="needs nvcc")
def test_one_consumer_refuses_pingpong(tmp_path):
    """SAGE_SM90_PINGPONG takes turns between two consumers: with one, the build stops at a static_assert."""
    flags = [f"-D{d}" for d in (*sage_sm90.Variant(64, torch.bfloat16, 128, True).defines, "SAGE_SM90_CONSUMERS=1",
                                "SAGE_SM90_PINGPONG=1")]
    res = subprocess.run([cuda_jit.find_nvcc(), "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", *flags,
                          "-o", str(tmp_path / "k.cubin"), str(SOURCE)], capture_output=True, text=True)
    assert res.returncode != 0 and "SAGE_SM90_PINGPONG takes turns between two consumers" in res.stderr, res.stderr


def _f16_constant(name: str) -> np.float16:
    """A packed f16x2 constant of ``exp2_e4m3x2`` (both halves the same), read from the source."""
    word = int(re.search(rf"{name} = 0x([0-9A-F]{{8}})u", SOURCE.read_text()).group(1), 16)
    assert word >> 16 == word & 0xFFFF
    return np.array([word & 0xFFFF], dtype=np.uint16).view(np.float16)[0]


def test_half_precision_exponential_is_far_inside_fp8_rounding():
    """``exp2_e4m3x2``'s arithmetic step for step in numpy float16 (each operation rounded, as the
    f16x2 instructions round): 2^x within 5e-3 relative over the fast path's exponents, unbiased, and
    almost always the same e4m3 code as the exact value's (fp8's steps are 6-12%)."""
    c1, c2, one, f1536, minus14 = (_f16_constant(n) for n in ("C1", "C2", "ONE", "F16_1536", "MINUS_14"))
    assert (one, f1536, minus14) == (1.0, 1536.0, -14.0)
    y = np.linspace(-14.0, 8.81, 200_001, dtype=np.float32)
    h = np.maximum(y.astype(np.float16), minus14)
    t = (h + f1536).astype(np.float16)
    f = (h - (t - f1536).astype(np.float16)).astype(np.float16)
    p = (f * c2 + c1).astype(np.float16)
    p = (p * f + one).astype(np.float16)
    bits = t.view(np.uint16).astype(np.int64) - 0x65F1  # n + 15: 2^n's exponent field
    assert bits.min() >= 1 and bits.max() <= 24
    pow2 = (bits << 10).astype(np.uint16).view(np.float16)
    got = (p * pow2).astype(np.float16).astype(np.float64)
    exact = 2.0 ** y.astype(np.float64)
    rel = (got - exact) / exact
    assert np.abs(rel).max() < 5e-3 and abs(rel.mean()) < 1e-3
    e4m3 = torch.float8_e4m3fn
    same = torch.tensor(got).to(e4m3) == torch.tensor(exact).to(e4m3)
    assert same.float().mean() > 0.97


@pytest.mark.parametrize("defines, rows, threads", [((), 128, 384), (("SAGE_SM90_CONSUMERS=1",), 64, 256)])
@pytest.mark.parametrize("skip_factor, collect_stats, return_lse", [(None, False, False), (0.5, True, True)])
def test_launch_packs_the_params_and_tensor_maps_the_kernel_reads(monkeypatch, skip_factor, collect_stats, return_lse,
                                                                  defines, rows, threads):
    """The host side with the kernel faked: the packed parameter block is ``_Params`` field for field, and the three
    TMA maps describe the quantized Q (boxes of the CTA's rows), K (``[tokens, heads * dim]`` bytes) and V^T, each
    encoded once for a repeated call (the block and the address list are reused between launches); the grid and the
    threads are the build's CTA's."""
    from diffusers_trtllm.kernels.triton_quant import TritonSage

    tokens, heads, kv_heads, dim = 300, 4, 2, 128
    layout = PackedLayout.dense(1, tokens, tokens, "cpu")
    q = torch.zeros(tokens, heads, dim, dtype=torch.bfloat16)
    k = torch.zeros(tokens, kv_heads, dim, dtype=torch.bfloat16)
    f32 = dict(dtype=torch.float32)
    st = TritonSage(q=torch.zeros(tokens, heads, dim, dtype=torch.int8),
                    k=torch.zeros(tokens, kv_heads, dim, dtype=torch.int8),
                    vt=torch.zeros(kv_heads * dim, 352, dtype=torch.uint8), q_scale=torch.zeros(heads, 5, **f32),
                    k_scale=torch.zeros(kv_heads, 12, **f32), v_scale=torch.zeros(kv_heads, dim, **f32),
                    v_mean=torch.zeros(kv_heads, dim, **f32), mma_key_order=True, k_mean=None)
    encoded, launches = [], []

    class Map:
        def __init__(self, *described):
            encoded.append(described)
            self.address = 1000 + len(encoded)

    class Kernel:
        def launch(self, grid, block, arguments, stream):
            size = ctypes.sizeof(sage_sm90._Params)
            params = sage_sm90._Params.from_buffer_copy(ctypes.string_at(arguments[3], size))
            launches.append((grid, block, list(arguments[:3]), stream, params))

    kernels = []
    monkeypatch.setattr(cuda_jit.TensorMap, "bytes_2d", Map)
    monkeypatch.setattr(cuda_jit, "_TENSOR_MAPS", {})
    monkeypatch.setattr(sage_sm90, "_check_call", lambda q, k, quant: None)
    monkeypatch.setattr(sage_sm90, "_kernel", lambda *args: kernels.append(args) or Kernel())
    monkeypatch.setattr(cuda_jit, "current_stream", lambda device: 77)
    monkeypatch.setattr(sage_sm90, "lse_before_smoothing", lambda lse, *args: lse)
    monkeypatch.setattr(sage_sm90, "_sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for _ in range(2):
        res = sage_sm90.sage_sm90_attention(q, k, k, layout, softmax_scale=0.125, quant=QuantConfig("int8"),
                                            skip_factor=skip_factor, collect_stats=collect_stats, quantized=st,
                                            return_lse=return_lse, defines=defines)
    assert encoded == [(st.q.data_ptr(), tokens, heads * dim, heads * dim, dim, rows),
                       (st.k.data_ptr(), tokens, kv_heads * dim, kv_heads * dim, dim, 128),
                       (st.vt.data_ptr(), kv_heads * dim, 352, 352, 128, dim)]
    assert kernels[0] == (q.device, dim, torch.bfloat16, 128, skip_factor is not None, defines)
    first, (grid, block, maps, stream, p) = launches  # p: the last call's, whose ``res`` is here
    assert (grid, block, maps, stream) == ((-(-tokens // rows), heads, 1), threads, [1001, 1002, 1003], 77)
    assert first[2] == maps
    count = collect_stats and skip_factor is not None
    quant = sage_sm90._route_quant(QuantConfig("int8"))
    assert [getattr(p, f) for f, _ in p._fields_] == [
        res.out.data_ptr(), st.q_scale.data_ptr(), st.k_scale.data_ptr(), st.v_scale.data_ptr(), st.v_mean.data_ptr(),
        layout.cu_seqlens_q.data_ptr(), layout.cu_seqlens_kv.data_ptr(), p.stats if count else res.out.data_ptr(),
        pytest.approx(0.125 * 1.4426950408889634), skip_factor or 0.0, 5, 12, heads * dim, dim, heads, 2,
        quant.q_block_size.bit_length() - 1, 7, int(count), int(sage_sm90.K_PER_THREAD),
        res.lse.data_ptr() if return_lse else None,
        layout.num_seqs]
    if count:
        assert p.stats not in (None, res.out.data_ptr())
    with pytest.raises(ValueError, match="quantized.q must be a contiguous tensor of 1-byte elements"):
        sage_sm90.sage_sm90_attention(q, k, k, layout, softmax_scale=0.125, quant=QuantConfig("int8"),
                                      quantized=replace(st, q=st.q.transpose(0, 1)))


def test_launch_holds_its_tensor_maps_while_the_cache_evicts(monkeypatch):
    """A call whose Q map is the cache's oldest entry and whose K and V maps are new, with the cache full: encoding
    K's map evicts Q's, which must stay alive (its descriptor's memory unfreed) until the kernel is launched."""
    import weakref

    from diffusers_trtllm.kernels.triton_quant import TritonSage

    tokens, heads, kv_heads, dim = 256, 2, 2, 64
    layout = PackedLayout.dense(1, tokens, tokens, "cpu")
    q = torch.zeros(tokens, heads, dim, dtype=torch.bfloat16)
    i8, f32 = dict(dtype=torch.int8), dict(dtype=torch.float32)
    st = TritonSage(q=torch.zeros(tokens, heads, dim, **i8), k=torch.zeros(tokens, kv_heads, dim, **i8),
                    vt=torch.zeros(kv_heads * dim, 304, dtype=torch.uint8), q_scale=torch.zeros(heads, 4, **f32),
                    k_scale=torch.zeros(kv_heads, 16, **f32), v_scale=torch.zeros(kv_heads, dim, **f32),
                    v_mean=torch.zeros(kv_heads, dim, **f32), mma_key_order=True, k_mean=None)
    maps = {}
    alive = []

    class Kernel:
        def launch(self, grid, block, arguments, stream):
            alive.append(maps["q"]() is not None and maps["q"]().address == arguments[0])

    monkeypatch.setattr(cuda_jit.TensorMap, "bytes_2d", classmethod(lambda cls, *key: cls()))
    monkeypatch.setattr(cuda_jit, "_TENSOR_MAPS", {})
    monkeypatch.setattr(sage_sm90, "_check_call", lambda q, k, quant: None)
    monkeypatch.setattr(sage_sm90, "_kernel", lambda *args: Kernel())
    monkeypatch.setattr(cuda_jit, "current_stream", lambda device: 0)
    cuda_jit.TensorMap.cached_bytes_2d(st.q.data_ptr(), tokens, heads * dim, heads * dim, dim, 128)
    maps["q"] = weakref.ref(next(iter(cuda_jit._TENSOR_MAPS.values())))
    for i in range(cuda_jit._TENSOR_MAPS_MAX - 1):
        cuda_jit._TENSOR_MAPS["filler", i] = cuda_jit.TensorMap()
    sage_sm90.sage_sm90_attention(q, q, q, layout, softmax_scale=0.125, quant=QuantConfig("int8"), quantized=st)
    assert alive == [True]
    assert maps["q"]() is None  # evicted, and freed once the call was done
