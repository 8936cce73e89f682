"""Baselines outside our routes: torch SDPA (cuDNN, FlashAttention-2), FlashInfer FA3 (bf16 and fp8), SageAttention.

Each entry prepares its own layout of the inputs once (outside the timed call)
and returns a zero-argument callable whose result is ``[batch, tokens, heads, dim]``.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..kernels import flashinfer_support

__all__ = ["BASELINE_CUDA", "BASELINE_CPU", "external_impls"]

BASELINE_CUDA = "torch-cudnn"
BASELINE_CPU = "torch-sdpa"
FP8_MAX = 448.0

Prepared = Callable[[], torch.Tensor]


def _torch_sdpa(q, k, v, scale, backend: SDPBackend | None) -> Prepared:
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))

    def run() -> torch.Tensor:
        if backend is None:
            return F.scaled_dot_product_attention(qh, kh, vh, scale=scale).transpose(1, 2)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qh, kh, vh, scale=scale).transpose(1, 2)

    return run


def _fa3(q, k, v, scale) -> Prepared:
    fi = flashinfer_support.flashinfer_or_none()
    return lambda: torch.stack(
        [fi.single_prefill_with_kv_cache(q[b], k[b], v[b], sm_scale=scale, backend="fa3") for b in range(q.shape[0])]
    )


def _per_head_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per (sequence, head): the coarse quantization FA3's fp8 path takes."""
    scale = x.float().abs().amax(dim=(1, 3)).clamp_min(1e-6) / FP8_MAX  # [B, H]
    return (x.float() / scale[:, None, :, None]).to(torch.float8_e4m3fn), scale


def _fa3_fp8(q, k, v, scale) -> Prepared:
    fi = flashinfer_support.flashinfer_or_none()
    (q8, sq), (k8, sk), (v8, sv) = (_per_head_fp8(x) for x in (q, k, v))
    out_dtype = q.dtype
    return lambda: torch.stack(
        [
            fi.single_prefill_with_kv_cache(
                q8[b], k8[b], v8[b], sq[b], sk[b], sv[b], o_dtype=out_dtype, sm_scale=scale, backend="fa3"
            )
            for b in range(q.shape[0])
        ]
    )


def _sageattn(q, k, v, scale) -> Prepared:
    sage = importlib.import_module("sageattention")
    k_own = k.clone()  # sageattn subtracts K's mean in place (smooth_k); keep the shared inputs intact
    return lambda: sage.sageattn(q, k_own, v, tensor_layout="NHD", is_causal=False, sm_scale=scale)


def external_impls(device: torch.device, dtype: torch.dtype) -> dict[str, tuple[Callable[..., Prepared], str | None]]:
    """Name -> (factory(q, k, v, scale), reason it cannot run here or None). The baseline comes first."""
    if device.type != "cuda":
        return {BASELINE_CPU: (lambda q, k, v, s: _torch_sdpa(q, k, v, s, None), None)}
    fi_missing = flashinfer_support.flashinfer_missing_reason()
    sm90 = torch.cuda.get_device_capability(device) == (9, 0)
    fa3_reason = fi_missing or (None if sm90 else "FA3 kernels need SM90")
    try:
        importlib.import_module("sageattention")
        sage_reason = None
    except Exception as err:
        sage_reason = f"sageattention not importable ({type(err).__name__}: {err})"
    return {
        BASELINE_CUDA: (lambda q, k, v, s: _torch_sdpa(q, k, v, s, SDPBackend.CUDNN_ATTENTION), None),
        "torch-flash2": (lambda q, k, v, s: _torch_sdpa(q, k, v, s, SDPBackend.FLASH_ATTENTION), None),
        "flashinfer-fa3": (_fa3, fa3_reason),
        "flashinfer-fa3-fp8": (_fa3_fp8, fa3_reason),
        "sageattn": (_sageattn, sage_reason),
    }
