"""``sage-sm90`` route: the project's CUDA C++ int8 SAGE + skip-softmax kernel for Hopper (H100, H200).

``csrc/sage_sm90.cu`` is an FA3-style kernel (a TMA producer warp, two consumer warpgroups, wgmma int8
Q·Kᵀ and fp8 P·V, the row sums added in fp32) written for sm_90a. It is compiled with ``nvcc`` at first use
and cached (``cuda_jit``); without ``nvcc`` the route reports that as its reason.

Semantics are the reference's with ``tile_q = 64``, ``tile_kv = 128`` and ``smooth_v``: SAGE as
docs/design.md defines it (int8 Q/K with per-block scales, K blocks of ``K_BLOCK`` split per thread as
``K_PER_THREAD`` says where the call leaves them to the route, ``smooth_k``, fp8 V per channel less its mean,
P as ``448 * p`` in fp8), quantized by the ``triton`` route's fused quantizer with V's keys in this kernel's register order.
Each row's log-sum-exp comes back where a call asks for it (ring attention's KV shards), as the ``triton`` route's.
A CTA serves 128 query rows of one sequence and head, or 64 with ``SAGE_SM90_CONSUMERS=1`` (one consumer
warpgroup, 256 threads, three K/V stages, two CTAs an SM: for 4-16k tokens, where the last wave's tail and each
CTA's prologue and epilogue weigh most): its GPU tests pass on an H200, where the kernel alone took 4% longer than
the default's at flux_1024 (0.411 against 0.394 ms, alternating rounds; sage_sm90_one_consumer_h200.md), so it is
not the default.
With ``SAGE_SM90_PERSISTENT=1`` it is persistent (issue 57): as many CTAs as the SMs hold (the device's SM count,
read once) up to the work tiles there are, each looping over tiles of its rows; measured 2-4% slower than one CTA
per tile on an H100, so not the default.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..config import K_BLOCK_SIZES, QuantConfig
from ..layout import PackedLayout
from ..routing.registry import AttentionCall, AttentionResult, Capabilities, Route, device_sm, register_route
from . import cuda_jit
from .reference import lse_before_smoothing
from .triton_attn import LOG2E, TritonAttentionOutput, check_heads, tile_output, triton_missing

if TYPE_CHECKING:  # triton_quant imports Triton, which this module leaves to first use
    from .triton_quant import TritonSage

__all__ = ["SageSm90Route", "Variant", "VARIANTS", "build_kernels", "sage_sm90_attention", "sage_sm90_quantize", "sage_sm90_cubin",
           "sage_sm90_missing", "kernel_name", "BLOCK_M", "BLOCK_N", "K_BLOCK", "K_PER_THREAD"]

#: The skip rule's tiles: 64 query rows (one consumer warpgroup) x 128 keys.
BLOCK_M, BLOCK_N = 64, 128
#: The K block of a call that leaves ``k_block_size`` to the route: one K scale per KV tile, the faster of the
#: kernel's blocks (H200: 1.447x / 1.531x cuDNN against 1.366x / 1.430x with 16 on wan_14b_480p / 720p, and a
#: Wan2.1-14B forward 1.152x / 1.268x against 1.120x / 1.218x; benchmarks/results/LOG.md, the fourth sweep).
K_BLOCK = 128
#: Whether that block is split per thread where the call leaves ``k_per_thread`` to the route (four K scales per
#: tile, one per quad lane; a thread's 32 scores of a row still share one): on the H200 as fast as unsplit, at
#: SageAttention2's K granularity and below its rel-L1 (0.0327 / 0.0323 against 0.0335 / 0.0326; run 23).
K_PER_THREAD = True
_SOURCE = "sage_sm90.cu"
#: ``SAGE_SM90_PERSISTENT``'s default in the source: one CTA per work tile (the persistent build measured slower).
PERSISTENT = False
#: ``SAGE_SM90_CONSUMERS``'s default in the source: two consumer warpgroups of ``BLOCK_M`` query rows a CTA.
CONSUMERS = 2
_OUT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class _Params(ctypes.Structure):
    """``sage_sm90::Params`` of the CUDA source, field for field."""

    _fields_ = [("out", ctypes.c_void_p), ("q_scale", ctypes.c_void_p), ("k_scale", ctypes.c_void_p),
                ("v_scale", ctypes.c_void_p), ("v_mean", ctypes.c_void_p), ("cu_q", ctypes.c_void_p), ("cu_kv", ctypes.c_void_p),
                ("stats", ctypes.c_void_p), ("qk_scale_log2", ctypes.c_float), ("skip_factor", ctypes.c_float),
                ("n_q_blocks", ctypes.c_int), ("n_k_blocks", ctypes.c_int), ("out_stride_t", ctypes.c_longlong),
                ("out_stride_h", ctypes.c_longlong), ("heads", ctypes.c_int), ("group", ctypes.c_int),
                ("q_shift", ctypes.c_int), ("k_shift", ctypes.c_int), ("count_skipped", ctypes.c_int),
                ("k_per_thread", ctypes.c_int), ("lse", ctypes.c_void_p), ("num_seqs", ctypes.c_int)]


#: ``_Params`` as ``struct`` packs it (no padding between its fields; the C struct's 4 bytes of tail padding are
#: in the block, unwritten), in one C call per launch.
_PARAMS = struct.Struct("=" + "".join({ctypes.c_void_p: "Q", ctypes.c_float: "f", ctypes.c_int: "i",
                                       ctypes.c_longlong: "q"}[t] for _, t in _Params._fields_))


class _Arguments(threading.local):
    """A thread's parameter block and ``cuLaunchKernel``'s list of argument addresses (three TMA maps, then the
    block): the driver copies both at the launch, so each launch refills the same memory."""

    def __init__(self) -> None:
        self.params = ctypes.create_string_buffer(ctypes.sizeof(_Params))
        self.addresses = (ctypes.c_void_p * 4)(0, 0, 0, ctypes.addressof(self.params))


_ARGUMENTS = _Arguments()


@dataclass(frozen=True)
class Variant:
    """One entry point of ``csrc/sage_sm90.cu``, built on its own (a cubin per variant, seconds each)."""

    head_dim: int
    out_dtype: torch.dtype
    k_block_size: int
    skip: bool

    @property
    def name(self) -> str:
        return f"sage_sm90_d{self.head_dim}_{_OUT_NAMES[self.out_dtype]}_k{self.k_block_size}" + ("_skip" if self.skip else "")

    @property
    def defines(self) -> tuple[str, ...]:
        """The source's selection of this entry point alone."""
        return (f"SAGE_SM90_HEAD_DIM={self.head_dim}", f"SAGE_SM90_OUT={_OUT_NAMES[self.out_dtype]}",
                f"SAGE_SM90_K_BLOCK={self.k_block_size}", f"SAGE_SM90_SKIP={int(self.skip)}")


def kernel_name(head_dim: int, dtype: torch.dtype, k_block_size: int, skip: bool) -> str:
    """The entry point of ``csrc/sage_sm90.cu`` for one head dim, output dtype, K block size and skip."""
    return Variant(head_dim, dtype, k_block_size, skip).name


#: Every entry point the source defines, as ``python -m diffusers_trtllm build-kernels`` builds them.
VARIANTS = tuple(Variant(d, t, kb, s) for d in (64, 128) for t in _OUT_NAMES for kb in K_BLOCK_SIZES for s in (False, True))
KERNEL_NAMES = tuple(v.name for v in VARIANTS)


def sage_sm90_missing() -> str | None:
    """Why the kernel cannot be built here (no NVRTC or nvcc, no triton for its quantizer), or None."""
    return triton_missing() or cuda_jit.compiler_missing()


@functools.lru_cache(maxsize=None)
def sage_sm90_cubin(variant: Variant, defines: tuple[str, ...] = (), compiler: cuda_jit.Compiler | None = None,
                    announce: bool = True) -> Path:
    """``variant``'s cubin for sm_90a with these other ``-D`` knobs, by ``compiler`` (None: the one found),
    compiled at first use (``announce``: saying so at WARNING level) and cached on disk."""
    return cuda_jit.compile_cubin(cuda_jit.source_path(_SOURCE), "90a", (*variant.defines, *defines),
                                  what=f"the sage-sm90 kernel {variant.name}", compiler=compiler, announce=announce)


def build_kernels(variants: Iterable[Variant] = VARIANTS, builds: Iterable[tuple[str, ...]] = ((),),
                  jobs: int | None = None) -> list[Path]:
    """Every ``variant`` of every build (``-D`` knobs), compiled ``jobs`` at a time, with a progress bar:
    ``python -m diffusers_trtllm build-kernels``, or a benchmark's builds ahead of a GPU session. Needs no GPU."""
    from tqdm.auto import tqdm

    compiler = cuda_jit.find_compiler()
    if compiler is None:
        raise RuntimeError(f"sage-sm90 {cuda_jit.compiler_missing()}")
    work = [(v, b) for b in builds for v in variants]
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        done = pool.map(lambda vb: sage_sm90_cubin(vb[0], vb[1], compiler, announce=False), work)
        return list(tqdm(done, total=len(work), desc=f"sage-sm90 kernels ({compiler.version})", unit="kernel"))


def _knob(defines: tuple[str, ...], name: str, default: int) -> int:
    """The value of the ``-D`` knob ``name`` in a build's defines, else ``default`` (the last wins, as with the
    compiler's ``-D``; a bare name is 1)."""
    value = default
    for define in defines:
        key, _, given = define.partition("=")
        if key.strip() == name:
            value = int(given or 1)
    return value


def _persistent(defines: tuple[str, ...]) -> bool:
    """Whether a build with these ``-D`` knobs is the persistent kernel."""
    return _knob(defines, "SAGE_SM90_PERSISTENT", PERSISTENT) != 0


class _Cta(NamedTuple):
    """What a launch needs of a build's CTA: its query rows (``BLOCK_M`` a consumer warpgroup), its threads (a
    warpgroup each, the producer's too), how many the source's ``__launch_bounds__`` fits on an SM (two with one
    consumer), and whether the kernel is persistent."""

    rows: int
    threads: int
    per_sm: int
    persistent: bool


@functools.lru_cache(maxsize=64)
def _cta(defines: tuple[str, ...]) -> _Cta:
    """The CTA of a build with these ``-D`` knobs (once per build: every call asks)."""
    consumers = _knob(defines, "SAGE_SM90_CONSUMERS", CONSUMERS)
    if consumers not in (1, 2):
        raise ValueError(f"SAGE_SM90_CONSUMERS is 1 or 2; got {consumers}")
    return _Cta(BLOCK_M * consumers, 128 * (consumers + 1), 2 if consumers == 1 else 1, _persistent(defines))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _grid(layout: PackedLayout, heads: int, cta: _Cta, device: torch.device) -> tuple[int, int, int]:
    """The launch grid: one CTA per (``cta.rows`` query rows, sequence x head), or for the persistent kernel as many
    as the SMs hold (``cta.per_sm`` each) up to the work tiles there are (a sequence without queries or keys has
    none), each looping over tiles."""
    if not cta.persistent:
        return (-(-layout.max_seqlen_q // cta.rows), layout.num_seqs * heads, 1)
    tiles = heads * sum(-(-lq // cta.rows) for lq, lkv in zip(layout.q_lens, layout.kv_lens) if lkv)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (max(1, min(tiles, cta.per_sm * _sm_count(index))), 1, 1)


def _kernel(device: torch.device, head_dim: int, out_dtype: torch.dtype, k_block_size: int, skip: bool,
            defines: tuple[str, ...] = ()) -> cuda_jit.CudaKernel:
    """The loaded entry point of ``Variant(head_dim, out_dtype, k_block_size, skip)``."""
    return _loaded_kernel(device, head_dim, out_dtype, k_block_size, skip, defines,
                          os.environ.get("DIFFUSERS_TRTLLM_NVCC"), os.environ.get("DIFFUSERS_TRTLLM_CACHE"))


@functools.lru_cache(maxsize=256)
def _loaded_kernel(device: torch.device, head_dim: int, out_dtype: torch.dtype, k_block_size: int, skip: bool,
                   defines: tuple[str, ...], nvcc: str | None, cache: str | None) -> cuda_jit.CudaKernel:
    """``_kernel``'s entry point, found once per device, variant, build, ``$DIFFUSERS_TRTLLM_NVCC`` (which
    ``find_compiler`` reads) and ``$DIFFUSERS_TRTLLM_CACHE`` (where the cubin is): a call of a known shape finds it
    without the compiler's or the cubin's lookups (nor building a ``Variant``)."""
    variant = Variant(head_dim, out_dtype, k_block_size, skip)
    cubin = sage_sm90_cubin(variant, defines, cuda_jit.find_compiler())
    return cuda_jit.load_kernels(cubin, (variant.name,), device)[variant.name]


@functools.lru_cache(maxsize=64)
def _route_quant(quant: QuantConfig) -> QuantConfig:
    """``quant`` with the K blocks it leaves to the route set to this kernel's (asked on every call)."""
    return quant.with_k_block(K_BLOCK, K_PER_THREAD)


def _check_call(q: torch.Tensor, k: torch.Tensor, quant: QuantConfig | None) -> None:
    check_heads(q, k, "sage-sm90")
    if device_sm(q.device) != 90:
        raise ValueError("the sage-sm90 kernel runs on Hopper GPUs (sm_90: H100, H200) only.")
    if q.dtype not in _OUT_NAMES:
        raise ValueError(f"the sage-sm90 kernel takes bf16 or fp16 Q/K/V; got {q.dtype}.")
    if quant is None or not quant.enabled or quant.dtype_qk != "int8":
        raise ValueError("the sage-sm90 kernel is int8 SAGE: pass quant=QuantConfig('int8', ...); "
                         "for other work use backend='auto'.")


def sage_sm90_quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout,
                       quant: QuantConfig) -> TritonSage:
    """The kernel's inputs: the ``triton`` route's fused quantizer, with V's keys in this kernel's order (K blocks
    of ``K_BLOCK`` where ``quant`` leaves them to the route)."""
    from .triton_quant import sage_quantize_triton

    return sage_quantize_triton(q, k, v, layout, _route_quant(quant), mma_key_order=True)


def _check_quantized(st: TritonSage) -> None:
    """Inputs given by the caller are what the kernel's TMA maps describe: contiguous bytes."""
    for name in ("q", "k", "vt"):
        x = getattr(st, name)
        if x.element_size() != 1 or not x.is_contiguous():
            raise ValueError(f"quantized.{name} must be a contiguous tensor of 1-byte elements; got {x.dtype} "
                             f"with strides {tuple(x.stride())}")


def sage_sm90_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: PackedLayout,
    *,
    softmax_scale: float,
    quant: QuantConfig,
    skip_factor: float | None = None,
    collect_stats: bool = False,
    defines: tuple[str, ...] = (),
    quantized: TritonSage | None = None,
    return_lse: bool = False,
) -> TritonAttentionOutput:
    """int8 SAGE attention (with skip-softmax when ``skip_factor`` is given) over packed ``[tokens, heads, dim]``;
    ``return_lse`` also returns each row's log-sum-exp (ring attention merges KV shards by it).

    ``defines`` builds the kernel with other compile-time knobs (``SAGE_SM90_STAGES=3``,
    ``SAGE_SM90_OVERLAP=0``); ``quantized``, what :func:`sage_sm90_quantize` made of these q, k, v, runs the
    kernel alone: both for the benchmark's sweeps. ``quant.k_block_size`` None takes ``K_BLOCK``."""
    quant = _route_quant(quant)
    _check_call(q, k, quant)
    st = quantized if quantized is not None else sage_sm90_quantize(q, k, v, layout, quant)
    if quantized is not None:
        _check_quantized(quantized)
    tokens_q, heads, dim = q.shape
    tokens_kv, kv_heads = k.shape[:2]
    device = q.device
    defines = tuple(defines)
    cta = _cta(defines)
    out = torch.empty(tokens_q, heads, dim, dtype=q.dtype, device=device)
    count = collect_stats and skip_factor is not None
    stats = torch.zeros(1, dtype=torch.int32, device=device) if count else out
    lse = torch.empty(tokens_q, heads, dtype=torch.float32, device=device) if return_lse else None
    # The quantized Q, K ([tokens, heads * dim] bytes) and V^T ([kv_heads * dim, padded tokens] bytes), contiguous.
    # The maps are held until the launch: encoding one may evict another from the cache, freeing its descriptor.
    tensor_map = cuda_jit.TensorMap.cached_bytes_2d
    vt_rows, vt_cols = st.vt.shape
    maps = (tensor_map(st.q.data_ptr(), tokens_q, heads * dim, heads * dim, dim, cta.rows),
            tensor_map(st.k.data_ptr(), tokens_kv, kv_heads * dim, kv_heads * dim, dim, BLOCK_N),
            tensor_map(st.vt.data_ptr(), vt_rows, vt_cols, vt_cols, BLOCK_N, dim))
    arguments = _ARGUMENTS.addresses
    arguments[0], arguments[1], arguments[2] = maps[0].address, maps[1].address, maps[2].address
    _PARAMS.pack_into(
        _ARGUMENTS.params, 0,
        out.data_ptr(), st.q_scale.data_ptr(), st.k_scale.data_ptr(), st.v_scale.data_ptr(), st.v_mean.data_ptr(),
        layout.cu_seqlens_q.data_ptr(), layout.cu_seqlens_kv.data_ptr(), stats.data_ptr(),
        softmax_scale * LOG2E, skip_factor or 0.0, st.q_scale.shape[1], st.k_scale.shape[1],
        heads * dim, dim, heads, heads // kv_heads,  # out's strides: it is contiguous [tokens, heads, dim]
        quant.q_block_size.bit_length() - 1, quant.k_block_size.bit_length() - 1, count, quant.k_per_thread,
        lse.data_ptr() if lse is not None else 0, layout.num_seqs,
    )
    # A skip factor of 0 can skip nothing (lambda = 0): the kernel without the vote gives the same output, faster.
    kernel = _kernel(device, dim, q.dtype, quant.k_block_size, bool(skip_factor), defines)
    kernel.launch(_grid(layout, heads, cta, device), cta.threads, arguments, cuda_jit.current_stream(device))
    if return_lse and st.k_mean is not None:  # the kernel's is of the logits less q . k_mean (smooth_k)
        lse = lse_before_smoothing(lse, st.dequantized_q(layout, quant.q_block_size), st.k_mean, softmax_scale)
    return tile_output(out, stats, layout, heads, BLOCK_M, BLOCK_N, collect_stats, skip_factor, lse)


class SageSm90Route(Route):
    """The CUDA int8 SAGE kernel for Hopper, with or without skip-softmax. ``ranked_routes`` puts it first
    for int8 SAGE on long keys, where it measured faster than the ``triton`` route (routing/order.py)."""

    name = "sage-sm90"
    caps = Capabilities(
        sms=frozenset({90}),
        head_dims=frozenset({64, 128}),
        skip_softmax=True,
        sage_dtypes=frozenset({"int8"}),
        k_per_thread=True,
        lse=True,
    )

    def extra_reasons(self, call: AttentionCall) -> list[str]:
        reasons = []
        if call.quant is None:
            reasons.append("runs int8 SAGE only (pass quant='int8')")
        missing = sage_sm90_missing()
        if missing:
            reasons.append(missing)
        return reasons

    def run(self, call: AttentionCall) -> AttentionResult:
        res = sage_sm90_attention(call.q, call.k, call.v, call.layout, softmax_scale=call.softmax_scale,
                                  quant=call.quant, skip_factor=call.skip_factor, collect_stats=call.collect_stats,
                                  return_lse=call.return_lse)
        return AttentionResult(res.out, self.name, res.skipped_tiles, res.total_tiles if call.collect_stats else None,
                               lse=res.lse)


register_route(SageSm90Route())
