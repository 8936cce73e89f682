"""Diffusers' ``RMSNorm`` in one launch (the QK norms of Qwen-Image, SD3.5 and HunyuanVideo).

Diffusers' ``RMSNorm.forward`` runs eagerly as six launches over the whole tensor through float32 intermediates
(``to(float32)``, ``pow``, ``mean``, the product with ``rsqrt``, the cast back, the weight's product): about 34
bytes moved per element, where one launch that reads ``x`` once and writes the result once moves 4 (bf16).
:func:`rms_norm` is that launch. Per row of ``D`` values, as the torch form rounds them::

    variance = sum(float(x) ** 2) / D                  # float32
    normed   = round(float(x) * rsqrt(variance + eps))   # to x's dtype, nearest even
    out      = round(float(normed) * float(weight))     # (no weight: out = normed)

Every step is torch's but the order of the sum of squares: torch's CUDA reduction sums in its own order, which
its releases have changed (the warp shuffle's direction, the vectorized loads), so a row's variance can differ in
its last bit and an output element by one rounding, rarely (measured on the GPU: ``tests/test_rms_norm.py``).
Under ``torch.compile`` Inductor fuses the torch form itself; on the CPU and off the kernel's layout
(:func:`fused_rms_norm_reasons`) the torch form runs, :func:`rms_norm_reference`.
"""

from __future__ import annotations

import contextlib

import torch

try:
    import triton
    import triton.language as tl

    from .triton_launch import cdiv, launch
except ImportError:  # the torch form serves every call
    triton = None

__all__ = ["rms_norm", "fused_rms_norm", "rms_norm_reference", "fused_rms_norm_reasons", "FUSED_WIDTHS"]

#: Row widths the kernel takes (head dims: SD3.5's 64, Qwen-Image's and HunyuanVideo's 128).
FUSED_WIDTHS = (32, 64, 128, 256)
_FUSED_DTYPES = (torch.bfloat16, torch.float16)
#: Values a program normalizes: 32 rows of 128 (16 KB in and out in bf16), as many values at other widths.
_BLOCK_VALUES = 4096


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Diffusers' ``RMSNorm.forward`` (no bias, no NPU) in torch."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    normed = x * torch.rsqrt(variance + eps)
    if weight is None:
        return normed.to(x.dtype)
    if weight.dtype in _FUSED_DTYPES:
        normed = normed.to(weight.dtype)
    return normed * weight


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, list[int]] | None:
    """``x`` as its storage's ``[rows, D]`` with the permutation that gives that order, where ``x`` fills its storage
    densely with the last dim innermost (a contiguous tensor, or a transposed view of one: SD3.5's ``[B, H, S, D]``);
    else None."""
    order = sorted(range(x.ndim - 1), key=lambda d: x.stride(d), reverse=True) + [x.ndim - 1]
    permuted = x.permute(order)
    if not permuted.is_contiguous():
        return None
    return permuted.view(-1, x.shape[-1]), order


def fused_rms_norm_reasons(x: torch.Tensor, weight: torch.Tensor | None) -> list[str]:
    """Why the one-launch kernel cannot normalize ``x`` (empty: it can)."""
    reasons = []
    if triton is None:
        reasons.append("needs the triton package")
    if not x.is_cuda or (weight is not None and weight.device != x.device):
        reasons.append("needs CUDA tensors on one device")
    if torch.compiler.is_compiling():
        reasons.append("under torch.compile (Inductor fuses the torch form)")
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        reasons.append("autograd is on and x or the weight requires grad: the kernel has no backward")
    if x.dtype not in _FUSED_DTYPES:
        reasons.append(f"x must be one of {_FUSED_DTYPES}; got {x.dtype}")
    if type(x) is not torch.Tensor:
        reasons.append(f"x must be a plain tensor; got a {type(x).__name__}")
    if weight is not None and (weight.dtype != x.dtype or weight.shape != x.shape[-1:] or not weight.is_contiguous()):
        reasons.append(f"the weight must be a contiguous [{x.shape[-1] if x.ndim else 0}] of x's dtype {x.dtype}; got "
                       f"{tuple(weight.shape)} {weight.dtype} with strides {weight.stride()}")
    if x.ndim < 2 or x.shape[-1] not in FUSED_WIDTHS:
        reasons.append(f"rows must be one of {FUSED_WIDTHS} values wide; got shape {tuple(x.shape)}")
    elif _rows(x) is None:
        reasons.append("x must fill its storage densely with its last dim innermost (a contiguous tensor or a "
                       "permutation of one)")
    return reasons


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Diffusers' ``RMSNorm`` of ``x`` over its last dim, one launch where :func:`fused_rms_norm_reasons` finds nothing
    against it (the output has ``x``'s strides, as the torch form's), else the torch form."""
    if fused_rms_norm_reasons(x, weight):
        return rms_norm_reference(x, weight, eps)
    return fused_rms_norm(x, weight, eps)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The kernel's launch, ``x`` as :func:`fused_rms_norm_reasons` accepts it (for callers that checked already, and
    the interpreter's tests on CPU tensors)."""
    rows, order = _rows(x)
    out = torch.empty_like(rows)
    if rows.numel():
        width = rows.shape[1]
        block_rows = _BLOCK_VALUES // width
        gain = rows if weight is None else weight.detach()  # a plain tensor: `launch` keeps launchers for those only
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            launch(_rms_norm_kernel, (cdiv(rows.shape[0], block_rows),), rows, gain, out, rows.shape[0], eps,
                   WIDTH=width, BLOCK_ROWS=block_rows, HAS_WEIGHT=weight is not None, num_warps=4,
                   enable_fp_fusion=False)
    inverse = sorted(range(x.ndim), key=order.__getitem__)
    return out.view([x.shape[d] for d in order]).permute(inverse)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x, weight, out, n_rows, eps, WIDTH: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                         HAS_WEIGHT: tl.constexpr):
        """Program: ``BLOCK_ROWS`` contiguous rows of ``WIDTH`` values, read once and written once; products rounded
        on their own (the launch turns fp fusion off), casts to nearest even, as torch's launches round them."""
        row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        col = tl.arange(0, WIDTH)
        keep = row[:, None] < n_rows
        offsets = row[:, None].to(tl.int64) * WIDTH + col[None, :]
        values = tl.load(x + offsets, mask=keep, other=0.0).to(tl.float32)
        variance = tl.sum(values * values, axis=1) * (1.0 / WIDTH)  # torch's mean: the sum times 1 / D
        scale = tl.math.rsqrt(variance + eps)
        normed = (values * scale[:, None]).to(out.dtype.element_ty)
        if HAS_WEIGHT:
            gain = tl.load(weight + col).to(tl.float32)
            normed = (normed.to(tl.float32) * gain[None, :]).to(out.dtype.element_ty)
        tl.store(out + offsets, normed, mask=keep)
