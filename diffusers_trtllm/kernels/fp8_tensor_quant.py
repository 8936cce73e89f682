"""fp8 e4m3 quantization with per-tensor Q/K scales, for kernels that take scalar scales (FMHAv2).

TRT-LLM's FMHAv2 in e4m3 folds the dequantization of Q and K into one host float
(``bmm1_scale``) and writes its output in bf16, so the finest scales it accepts for
Q and K are one per tensor. Two exact rewrites keep the accuracy close to SAGE's
per-block fp8 (docs/design.md, "fp8 on FMHAv2"):

- K is smoothed: the per-(head, channel) mean of K over all tokens is subtracted
  before quantizing. That shifts every logit of a query row by the same amount,
  which softmax ignores, and leaves fp8's range to the part of K that varies.
- V is smoothed and scaled per (head, channel): ``v' = (v - mean) / scale``. The
  kernel computes ``P·v'`` with rows of P summing to one, so
  ``out = (P·v') * scale + mean`` restores it (``restore_output``).

The scales stay on the device; only their product for Q and K, which ``bmm1_scale``
needs on the host, is copied back, after the quantizer is queued, so the GPU waits
only for the attention kernel's launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import AMAX_FLOOR, FP8_MAX, channel_mean, key_mean, lse_before_smoothing, per_q_head

__all__ = ["Fp8TensorQuant", "quantize_fp8_per_tensor", "restore_output", "restore_lse"]


@dataclass
class Fp8TensorQuant:
    """Quantized inputs in FMHAv2's ``CONTIGUOUS_Q_KV`` layout and what undoes the scaling."""

    q: torch.Tensor  # [tokens_q, heads, dim] float8_e4m3fn
    kv: torch.Tensor  # [tokens_kv, 2, kv_heads, dim] float8_e4m3fn (K smoothed, V smoothed and scaled)
    qk_scale: float  # scale_q * scale_k, to fold into bmm1_scale
    v_scale: torch.Tensor  # [kv_heads, dim] float32
    v_mean: torch.Tensor  # [kv_heads, dim] float32
    k_mean: torch.Tensor  # [kv_heads, dim] float32


def _centered_amax(x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Per-(head, channel) max of ``|x - mean|`` over tokens, without materialising ``x - mean``."""
    lo, hi = torch.aminmax(x, dim=0)
    return torch.maximum(hi.float() - mean, mean - lo.float())


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize_fp8_per_tensor(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Fp8TensorQuant:
    """Quantize packed ``[tokens, heads, dim]`` Q, K, V; one fused Triton pass on CUDA, torch elsewhere."""
    k_mean = key_mean(k)
    v_mean = channel_mean(v)
    v_scale = _centered_amax(v, v_mean).clamp_min(AMAX_FLOOR) / FP8_MAX  # [kv_heads, dim]
    q_lo, q_hi = torch.aminmax(q)
    amax = torch.stack([torch.maximum(-q_lo.float(), q_hi.float()), _centered_amax(k, k_mean).max()])
    qk_scales = amax.clamp_min(AMAX_FLOOR) / FP8_MAX  # [scale_q, scale_k], on the device
    tokens_kv, kv_heads, dim = k.shape
    if q.device.type == "cuda" and _triton_kernel is not None:
        q8 = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)
        kv8 = torch.empty(tokens_kv, 2, kv_heads, dim, dtype=torch.float8_e4m3fn, device=q.device)
        _launch(q, k, v, q8, kv8, qk_scales, k_mean, v_mean, v_scale)
    else:
        q8 = _to_fp8(q.float() / qk_scales[0])
        kv8 = torch.stack([_to_fp8((k.float() - k_mean) / qk_scales[1]), _to_fp8((v.float() - v_mean) / v_scale)], dim=1)
    q_scale, k_scale = qk_scales.tolist()  # the one host sync, with the quantizer already queued
    return Fp8TensorQuant(q8, kv8, q_scale * k_scale, v_scale, v_mean, k_mean)


def restore_output(out: torch.Tensor, quant: Fp8TensorQuant) -> torch.Tensor:
    """Undo V's smoothing and per-channel scale on the kernel's ``[tokens, heads, dim]`` output."""
    scale, mean = (per_q_head(x, out.shape[1]) for x in (quant.v_scale, quant.v_mean))
    return torch.addcmul(mean.to(out.dtype), out, scale.to(out.dtype))


def restore_lse(lse: torch.Tensor, q: torch.Tensor, quant: Fp8TensorQuant, softmax_scale: float) -> torch.Tensor:
    """Undo K's smoothing on the kernel's ``[tokens, heads]`` log-sum-exp (``q``: the unquantized queries)."""
    return lse_before_smoothing(lse, q, quant.k_mean, softmax_scale)


try:  # the fused CUDA quantizer; without Triton the torch path above runs everywhere
    import triton
    import triton.language as tl

    from .triton_launch import cdiv, launch
except ImportError:  # pragma: no cover - triton is a test dependency
    _triton_kernel = None
else:

    @triton.jit
    def _triton_kernel(
        q_ptr, k_ptr, v_ptr, qo_ptr, kvo_ptr, qk_scale_ptr, k_mean_ptr, v_mean_ptr, v_scale_ptr,
        tokens_q, tokens_kv,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
    ):
        """One program: BLOCK_T tokens of one head; Q rows, and K and V rows when the head has them."""
        head = tl.program_id(1)
        tok = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        dims = tl.arange(0, D)
        q_ok = tok < tokens_q
        q = tl.load(q_ptr + tok[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=q_ok[:, None], other=0.0)
        q = tl.clamp(q.to(tl.float32) / tl.load(qk_scale_ptr), -448.0, 448.0)
        tl.store(qo_ptr + tok[:, None] * (H * D) + head * D + dims[None, :], q.to(tl.float8e4nv), mask=q_ok[:, None])
        if head < HKV:
            kv_ok = tok < tokens_kv
            out = kvo_ptr + tok[:, None] * (2 * HKV * D) + head * D + dims[None, :]
            k = tl.load(k_ptr + tok[:, None] * stride_kt + head * stride_kh + dims[None, :], mask=kv_ok[:, None], other=0.0)
            k = (k.to(tl.float32) - tl.load(k_mean_ptr + head * D + dims)[None, :]) / tl.load(qk_scale_ptr + 1)
            tl.store(out, tl.clamp(k, -448.0, 448.0).to(tl.float8e4nv), mask=kv_ok[:, None])
            v = tl.load(v_ptr + tok[:, None] * stride_vt + head * stride_vh + dims[None, :], mask=kv_ok[:, None], other=0.0)
            v = (v.to(tl.float32) - tl.load(v_mean_ptr + head * D + dims)[None, :]) / tl.load(v_scale_ptr + head * D + dims)[None, :]
            tl.store(out + HKV * D, tl.clamp(v, -448.0, 448.0).to(tl.float8e4nv), mask=kv_ok[:, None])


#: Tokens per program of the fused quantizer.
_BLOCK_T = 64


def _launch(q, k, v, q8, kv8, qk_scales, k_mean, v_mean, v_scale) -> None:
    tokens_q, heads, dim = q.shape
    tokens_kv, kv_heads, _ = k.shape
    grid = (cdiv(max(tokens_q, tokens_kv), _BLOCK_T), heads)
    launch(
        _triton_kernel, grid, q, k, v, q8, kv8, qk_scales, k_mean, v_mean, v_scale,
        tokens_q, tokens_kv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        H=heads, HKV=kv_heads, D=dim, BLOCK_T=_BLOCK_T, num_warps=4,
    )
