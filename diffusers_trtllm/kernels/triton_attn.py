"""``triton`` route: the project's own forward attention kernel, for SM80 and newer.

One kernel serves dense bf16/fp16, SAGE (int8 or fp8 e4m3 QK with per-block
scales, fp8 P·V with per-channel V scales, V less its mean which the epilogue adds back; see
``triton_quant``) and the
skip-softmax tile rule, over ragged batches (``cu_seqlens``), non-causal, head
dim 64 or 128. It exists because FlashInfer's SAGE kernels need SM100+: on
Hopper (and Ampere/Ada) this is the only route that serves ``quant=...``.

Semantics are the reference's (``reference.reference_attention``) with
``tile_q = BLOCK_M`` and ``tile_kv = BLOCK_N`` (SAGE 64 x 128, dense 128 x 128 by
default, from H200 sweeps; ``KernelConfig`` overrides them): scores live in the
log2 domain (``log2(e)`` folded into the scale), P is formed as ``448 * p`` directly
(``exp2((s - m) * scale + log2 448)``, never above 448 for any finite input) and
cast to fp8, and the row sum carries the same factor, so it cancels. NaN or inf in
Q/K/V gives a non-finite output, as torch's attention does. On request the kernel also
writes each row's log-sum-exp (``[tokens, heads]`` float32, natural log of the scaled
logits' exponent sum, the reference's ``lse``): ring attention merges KV shards by it.
Hopper tools: tensor descriptors (TMA) for every tile load, software-pipelined
KV loop (``num_stages``), int8 ``tl.dot`` into int32 and fp8 ``tl.dot``.

Triton is a guarded import: without it the module still imports and the route
reports the missing package.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..config import DEFAULT_K_BLOCK, QuantConfig
from ..layout import PackedLayout
from ..routing.registry import AttentionCall, AttentionResult, Capabilities, Route, device_sm, register_route
from .reference import lse_before_smoothing

__all__ = ["TritonRoute", "TritonAttentionOutput", "triton_attention", "triton_missing", "KernelConfig"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes (they define the skip rule's tiles) and launch knobs."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    warp_specialize: bool = False


#: Launch knobs by qk kind, picked from H200 sweeps (benchmarks/bench_triton.py --sweep).
_TUNED: dict[str, KernelConfig] = {
    "dense": KernelConfig(128, 128, 8, 3, warp_specialize=True),
    "int8": KernelConfig(64, 128, 4, 3),
    "fp8_e4m3": KernelConfig(64, 128, 4, 3),
}


def default_config(qk_kind: str) -> KernelConfig:
    return _TUNED[qk_kind]


@dataclass
class TritonAttentionOutput:
    out: torch.Tensor
    skipped_tiles: int | None
    total_tiles: int
    #: ``[tokens, heads]`` float32 natural log-sum-exp per row, when asked for (``return_lse``).
    lse: torch.Tensor | None = None


try:  # optional dependency: without it the route reports why it cannot run
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError as exc:  # pragma: no cover - exercised only where triton is absent
    triton = None
    _TRITON_MISSING: str | None = f"needs the triton package with tensor descriptors (pip install 'triton>=3.4'): {exc}"
else:
    _TRITON_MISSING = None

if triton is not None:
    from . import triton_quant
    from .triton_launch import cdiv, launch
    from triton.language.extra import libdevice

    from .reference import FP16_MAX
    from .triton_quant import max_nan, round_fp8_grid, vt_start

    _LOG2_P_SCALE = tl.constexpr(math.log2(448.0))
    _LN2 = tl.constexpr(LN2)
    #: The largest finite fp16: SAGE outputs are clamped to it (NaN kept) before an fp16 store.
    _FP16_MAX = tl.constexpr(FP16_MAX)

    @triton.jit
    def _update(acc, l_i, m_i, s, q_row_scale, local, desc_v, v_row, v_col, SAGE: tl.constexpr,
                NATIVE: tl.constexpr):
        """Online-softmax update with one KV tile; log2-domain scores are ``s * q_row_scale``.

        The running max ``m_i`` is kept in ``s``'s units and subtracted before the row
        scale, so ``s - m <= 0`` exactly and ``p`` stays in the fp16/fp8 range whatever
        the magnitude (``s`` is rounded once, see ``_tile``).
        """
        m_new = tl.maximum(m_i, local)
        alpha = tl.math.exp2((m_i - m_new) * q_row_scale)
        if SAGE:  # 448 * p, ready for the fp8 cast; l carries the same factor
            p = tl.math.exp2((s - m_new[:, None]) * q_row_scale[:, None] + _LOG2_P_SCALE)
        else:
            p = tl.math.exp2((s - m_new[:, None]) * q_row_scale)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if SAGE:
            vt = desc_v.load([v_row, v_col])  # [HEAD_DIM, BLOCK_N], tokens contiguous
            if NATIVE:
                pq = p.to(tl.float8e4nv)
            else:
                pq = round_fp8_grid(p).to(tl.float16)
            acc = tl.dot(pq, vt.T, acc)
        else:
            v = desc_v.load([v_row, v_col])
            acc = tl.dot(p.to(v.dtype), v, acc)
        return acc, l_i, m_new

    @triton.jit
    def _rounded_product(a, b, COMPILED: tl.constexpr):
        """``a * b`` rounded once (PTX ``mul.rn``, which is never contracted into an FMA).

        A plain product may be fused into the later ``s - m`` as one FMA of the unrounded
        value, which then differs from the rounded ``s`` the row max was taken from by up to
        half an ulp of ``|s|``: at scores of 1e8 and more, times the row scale, an exponent
        of hundreds either way (all-zero or inf rows, measured on the H200). The interpreter
        has no libdevice and rounds every product anyway.
        """
        if COMPILED:
            return libdevice.mul_rn(a, b)
        else:
            return a * b

    @triton.jit
    def _tile(acc, l_i, m_i, n_skipped, q, q_row_scale, row_ok, desc_k, desc_v, k_scale_ptr, k_scale_first,
              kv_start, v_start, start_n, kv_len, kv_col, log2_lam, qk_scale,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr, K_BS: tl.constexpr,
              MASK: tl.constexpr, SKIP: tl.constexpr, NATIVE: tl.constexpr, COMPILED: tl.constexpr):
        """One KV tile: scores, the skip decision, and (unless skipped) the softmax/P·V update."""
        cols = start_n + tl.arange(0, BLOCK_N)
        k = desc_k.load([kv_start + start_n, kv_col])
        # s: scores before the per-row factor q_row_scale (> 0), applied in the exponent's FMA.
        if QUANT == 0:
            s = tl.dot(q, k.T)
        else:
            if QUANT == 1:  # |int8 dot| < 2**22: adding 1.5 * 2**23's bit pattern makes an exact float
                s = (tl.dot(q, k.T, out_dtype=tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
            else:
                s = tl.dot(q, k.T)
            k_scale = tl.load(k_scale_ptr + k_scale_first + cols // K_BS, mask=cols < kv_len, other=0.0)[None, :]
            s = _rounded_product(s, k_scale, COMPILED)
        if MASK:
            s = tl.where((cols < kv_len)[None, :], s, -float("inf"))
        local = max_nan(s, 1)  # NaN rows stay NaN, so the skip rule keeps their tiles (as the reference)
        if QUANT == 0:
            v_row, v_col = kv_start + start_n, kv_col
        else:
            v_row, v_col = kv_col, v_start + start_n
        if SKIP:
            excess = max_nan(tl.where(row_ok, (local - m_i) * q_row_scale, -float("inf")), 0)
            keep = (start_n == 0) | (excess >= log2_lam) | (excess != excess)
            n_skipped += 1 - keep.to(tl.int32)
            if keep:
                acc, l_i, m_i = _update(acc, l_i, m_i, s, q_row_scale, local, desc_v, v_row, v_col, QUANT != 0, NATIVE)
        else:
            acc, l_i, m_i = _update(acc, l_i, m_i, s, q_row_scale, local, desc_v, v_row, v_col, QUANT != 0, NATIVE)
        return acc, l_i, m_i, n_skipped

    @triton.jit
    def _attn_fwd(
        desc_q, desc_k, desc_v, out_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, v_mean_ptr, stats_ptr, lse_ptr,
        cu_q_ptr, cu_kv_ptr, qk_scale, skip_factor, n_q_blocks, n_k_blocks, stride_ot, stride_oh,
        H: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        QUANT: tl.constexpr, Q_BS: tl.constexpr, K_BS: tl.constexpr, SKIP: tl.constexpr, STATS: tl.constexpr,
        LSE: tl.constexpr, NATIVE: tl.constexpr, COMPILED: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    ):
        m0 = tl.program_id(0) * BLOCK_M
        seq = tl.program_id(1) // H
        head = tl.program_id(1) % H
        kv_head = head // GROUP
        q_start = tl.load(cu_q_ptr + seq)
        q_len = tl.load(cu_q_ptr + seq + 1) - q_start
        if m0 < q_len:
            kv_start = tl.load(cu_kv_ptr + seq)
            kv_len = tl.load(cu_kv_ptr + seq + 1) - kv_start
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < q_len
            dims = tl.arange(0, HEAD_DIM)
            q = desc_q.load([q_start + m0, head * HEAD_DIM])
            if QUANT == 0:
                q_row_scale = qk_scale
                k_scale_first = 0
                v_start = kv_start
            else:
                q_first = head * n_q_blocks + q_start // Q_BS + seq
                q_row_scale = tl.load(q_scale_ptr + q_first + rows // Q_BS, mask=row_ok, other=1.0) * qk_scale
                k_scale_first = kv_head * n_k_blocks + kv_start // K_BS + seq
                v_start = vt_start(seq, kv_start)
            log2_lam = tl.log2(skip_factor / kv_len.to(tl.float32))  # -inf when skip_factor == 0
            m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            n_skipped = tl.full((), 0, tl.int32)
            kv_col = kv_head * HEAD_DIM
            full = (kv_len // BLOCK_N) * BLOCK_N
            for start_n in tl.range(0, full, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
                acc, l_i, m_i, n_skipped = _tile(
                    acc, l_i, m_i, n_skipped, q, q_row_scale, row_ok, desc_k, desc_v, k_scale_ptr, k_scale_first,
                    kv_start, v_start, start_n, kv_len, kv_col, log2_lam, qk_scale,
                    HEAD_DIM, BLOCK_N, QUANT, K_BS, False, SKIP, NATIVE, COMPILED)
            if full < kv_len:  # the ragged last tile, masked
                acc, l_i, m_i, n_skipped = _tile(
                    acc, l_i, m_i, n_skipped, q, q_row_scale, row_ok, desc_k, desc_v, k_scale_ptr, k_scale_first,
                    kv_start, v_start, full, kv_len, kv_col, log2_lam, qk_scale,
                    HEAD_DIM, BLOCK_N, QUANT, K_BS, True, SKIP, NATIVE, COMPILED)
            o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            if QUANT != 0:
                vc = kv_head * HEAD_DIM + dims  # V's scales, then its mean (smooth_v) back
                o = o * tl.load(v_scale_ptr + vc)[None, :] + tl.load(v_mean_ptr + vc)[None, :]
                if out_ptr.dtype.element_ty == tl.float16:  # fp8's rounding of V less its mean may overshoot
                    o = tl.clamp(o, -_FP16_MAX, _FP16_MAX, propagate_nan=tl.PropagateNan.ALL)
            tok = (q_start + rows).to(tl.int64)
            tl.store(out_ptr + tok[:, None] * stride_ot + head * stride_oh + dims[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
            if LSE:  # log2 of the row sum, less SAGE's 448 factor, plus the max in log2 units; then natural log
                lse2 = m_i * q_row_scale + tl.log2(l_i)
                if QUANT != 0:
                    lse2 = lse2 - _LOG2_P_SCALE
                tl.store(lse_ptr + tok * H + head, lse2 * _LN2, mask=row_ok)
            if STATS:
                tl.atomic_add(stats_ptr, n_skipped)



def triton_missing() -> str | None:
    """Why the triton route (and the quantizer other routes share) cannot run here, or None."""
    return _TRITON_MISSING


def check_heads(q: torch.Tensor, k: torch.Tensor, route: str) -> None:
    """Head dim 64/128 and whole query groups per KV head, or an error naming ``route``."""
    heads, dim = q.shape[1:]
    kv_heads = k.shape[1]
    if dim not in (64, 128):
        raise ValueError(f"the {route} route supports head dim 64 or 128; got {dim}.")
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({kv_heads}).")


def tile_output(out: torch.Tensor, stats: torch.Tensor, layout: PackedLayout, heads: int, bm: int, bn: int,
                collect_stats: bool, skip_factor: float | None, lse: torch.Tensor | None = None) -> TritonAttentionOutput:
    """The kernel's output with its skip statistics over ``bm x bn`` tiles (``stats``: the skipped count)."""
    total = heads * sum(-(-lq // bm) * -(-lkv // bn) for lq, lkv in zip(layout.q_lens, layout.kv_lens) if lq and lkv)
    skipped = int(stats.item()) if collect_stats and skip_factor is not None else (0 if collect_stats else None)
    return TritonAttentionOutput(out, skipped, total, lse)


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """``[tokens, heads * dim]`` view of ``[tokens, heads, dim]`` that TMA can describe (a copy if it cannot)."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2] or (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
        x = x.contiguous()
    return x.view(x.shape[0], -1)


def _rows_desc(x: torch.Tensor, block: list[int]):
    """TMA descriptor over ``[tokens, heads * dim]`` (a view of ``[tokens, heads, dim]``), or over a 2-D tensor."""
    return TensorDescriptor.from_tensor(rows_view(x) if x.dim() == 3 else x, block)


@dataclass
class KernelOperands:
    """What the triton and gluon kernels read besides the layout: TMA descriptors of Q, K and V (with
    SAGE: the quantized Q and K and fp8 ``V^T``), SAGE's scales, and their block counts and sizes
    (placeholders, never read, without SAGE), and the quantized inputs themselves (None without SAGE)."""

    descs: tuple
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # Q's, K's, V's scales and V's mean
    n_blocks: tuple[int, int]
    block_sizes: tuple[int, int]
    sage: triton_quant.TritonSage | None = None


def kernel_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout,
                    quant: QuantConfig | None, placeholder: torch.Tensor, block_m: int, block_n: int,
                    describe: Callable[[torch.Tensor, list[int]], Any] = _rows_desc) -> KernelOperands:
    """Quantize for SAGE when ``quant`` asks (``triton_quant``'s fused quantizer) and describe the
    operands with ``describe(tensor, block)``; ``placeholder`` stands in for the scales without SAGE."""
    dim = q.shape[-1]
    if quant is not None and quant.enabled:
        quant = quant.with_k_block(DEFAULT_K_BLOCK)
        if quant.k_per_thread:
            raise ValueError("the triton and gluon kernels read one K scale per block; quant.k_per_thread=True is "
                             "the sage-sm90 kernel's: pass k_per_thread=False here, or use backend='auto' on Hopper.")
        st = triton_quant.sage_quantize_triton(q, k, v, layout, quant)
        return KernelOperands(
            (describe(st.q, [block_m, dim]), describe(st.k, [block_n, dim]), describe(st.vt, [dim, block_n])),
            (st.q_scale, st.k_scale, st.v_scale, st.v_mean),
            (st.q_scale.shape[1], st.k_scale.shape[1]),
            (quant.q_block_size, quant.k_block_size),
            st,
        )
    return KernelOperands((describe(q, [block_m, dim]), describe(k, [block_n, dim]), describe(v, [block_n, dim])),
                          (placeholder,) * 4, (0, 0), (1, 1))


def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: PackedLayout,
    *,
    softmax_scale: float,
    skip_factor: float | None = None,
    quant: QuantConfig | None = None,
    collect_stats: bool = False,
    return_lse: bool = False,
    config: KernelConfig | None = None,
) -> TritonAttentionOutput:
    """Attention over packed ``[tokens, heads, dim]`` tensors with the Triton kernel.

    ``config`` overrides the tuned tile sizes and launch knobs (tests use small
    tiles; the skip rule's tiles are ``block_m x block_n``). ``return_lse`` also
    returns each row's log-sum-exp.
    """
    if _TRITON_MISSING:
        raise RuntimeError(_TRITON_MISSING)
    tokens_q, heads, dim = q.shape
    kv_heads = k.shape[1]
    check_heads(q, k, "triton")
    sage = quant is not None and quant.enabled
    qk_kind = quant.dtype_qk if sage else "dense"
    cfg = config or default_config(qk_kind)
    bm, bn = cfg.block_m, cfg.block_n
    out = torch.empty(tokens_q, heads, dim, dtype=q.dtype, device=q.device)
    ops = kernel_operands(q, k, v, layout, quant, out, bm, bn)
    quant_code = 0 if not sage else 1 if quant.dtype_qk == "int8" else 2
    stats = torch.zeros(1, dtype=torch.int32, device=q.device) if collect_stats else out  # out: never written
    lse = torch.empty(tokens_q, heads, dtype=torch.float32, device=q.device) if return_lse else out  # never written
    grid = (cdiv(layout.max_seqlen_q, bm), layout.num_seqs * heads)
    launch(
        _attn_fwd, grid, *ops.descs, out, *ops.scales, stats, lse,
        layout.cu_seqlens_q, layout.cu_seqlens_kv, softmax_scale * LOG2E,
        float(skip_factor or 0.0), *ops.n_blocks, out.stride(0), out.stride(1),
        H=heads, GROUP=heads // kv_heads, HEAD_DIM=dim, BLOCK_M=bm, BLOCK_N=bn,
        QUANT=quant_code, Q_BS=ops.block_sizes[0], K_BS=ops.block_sizes[1],
        SKIP=skip_factor is not None, STATS=collect_stats and skip_factor is not None, LSE=return_lse,
        NATIVE=triton_quant.fp8_native(q.device), COMPILED=not triton_quant.interpreting(), WARP_SPECIALIZE=cfg.warp_specialize,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if return_lse and ops.sage is not None and ops.sage.k_mean is not None:
        lse = lse_before_smoothing(lse, ops.sage.dequantized_q(layout, ops.block_sizes[0]), ops.sage.k_mean,
                                   softmax_scale)
    return tile_output(out, stats, layout, heads, bm, bn, collect_stats, skip_factor, lse if return_lse else None)


class TritonRoute(Route):
    """The project's Triton kernel: dense, skip-softmax and SAGE on SM80+ (fp8 QK on SM89+)."""

    name = "triton"
    caps = Capabilities(
        min_sm=80,
        head_dims=frozenset({64, 128}),
        skip_softmax=True,
        sage_dtypes=frozenset({"int8", "fp8_e4m3"}),
        lse=True,
    )

    def extra_reasons(self, call: AttentionCall) -> list[str]:
        reasons = []
        if _TRITON_MISSING:
            reasons.append(_TRITON_MISSING)
        sm = device_sm(call.q.device)
        if call.quant is not None and call.quant.dtype_qk == "fp8_e4m3" and sm is not None and sm < 89:
            reasons.append(f"fp8 e4m3 QK needs SM >= 89 (this GPU is sm_{sm}); use quant dtype_qk='int8'")
        return reasons

    #: The host function ``run`` calls (a subclass with the same interface swaps it).
    attention = staticmethod(triton_attention)

    def run(self, call: AttentionCall) -> AttentionResult:
        res = self.attention(
            call.q,
            call.k,
            call.v,
            call.layout,
            softmax_scale=call.softmax_scale,
            skip_factor=call.skip_factor,
            quant=call.quant,
            collect_stats=call.collect_stats,
            return_lse=call.return_lse,
        )
        return AttentionResult(res.out, self.name, res.skipped_tiles, res.total_tiles if call.collect_stats else None,
                               lse=res.lse)


register_route(TritonRoute())
