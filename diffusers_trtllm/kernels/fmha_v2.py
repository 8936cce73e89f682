"""``fmha-v2`` route: TRT-LLM's FMHAv2 through ``flashinfer.prefill.trtllm_fmha_v2_prefill``.

The Hopper (SM90) home of skip-softmax: FlashInfer's trtllm-gen kernels refuse
SM90, and FMHAv2's warp-specialized SM90 kernels carry the same skip rule. Called
with the ragged ``SEPARATE_Q_K_V`` layout and ``mask_mode="padding"`` (plain
non-causal attention inside each sequence; an unknown mode string would silently
mean causal). In FlashInfer 0.7.4 the skip rule, per sequence, is
``exp(local_max - running_max) < skip_softmax_threshold_scale_factor / kv_len``,
voted over 64 query rows (one warpgroup) and one KV step (256 / 128 / 64 keys for
head dim 64 / 128 / 256), the first KV step never skipped: docs/design.md's rule (Semantics), with
those tiles. SM120 gets dense kernels only (no skip-softmax kernels are generated
there). Everything compiles by JIT on first use (about 80 s per dtype).

Measured on the H200 (FlashInfer 0.7.4), on ragged batches: a sequence with fewer
queries than keys comes out wrong (rel-L1 0.2-0.3, for that sequence or another one
of the batch); with more queries than keys, or grouped-query heads, outputs hold
NaNs, sometimes only (run to run). So this route serves only batches whose every
sequence has as many queries as keys, with one KV head per query head; other calls
go to another route.
"""

from __future__ import annotations

import torch

from ..routes import AttentionCall, AttentionResult, Capabilities, Route, device_sm, register_route
from . import _flashinfer
from ._dense_order import PREFERRED, MeasuredDenseOrder

__all__ = ["FmhaV2Route", "SKIP_SMS", "kv_step", "Q_STEP", "prefill", "fmha_v2_reasons"]

#: SMs whose FMHAv2 kernels FlashInfer builds with skip-softmax.
SKIP_SMS = frozenset({90})
#: Query rows that vote together on skipping a KV step (one SM90 warpgroup).
Q_STEP = 64
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def kv_step(head_dim: int) -> int:
    """Keys per KV step of the SM90 bf16/fp16 kernels (FlashInfer's ``kv_loop_step``)."""
    return 256 if head_dim <= 64 else 128 if head_dim <= 128 else 64


def module_uri(dtype: torch.dtype) -> str:
    """Name of FlashInfer's JIT module for this layout and dtype (one module holds every head dim)."""
    name = _DTYPE_NAMES[dtype]
    return f"trtllm_fmha_v2_separate_q_k_v_{name}_{name}"


def fmha_v2_reasons(call: AttentionCall, uri: str) -> list[str]:
    """Why FlashInfer's fmha-v2 (JIT module ``uri``) cannot serve ``call``, beyond the capability table."""
    missing = _flashinfer.flashinfer_missing_reason()
    if missing:
        return [missing]
    reasons = []
    if call.v.shape[-1] != call.q.shape[-1]:
        reasons.append(f"value head dim {call.v.shape[-1]} differs from query head dim {call.q.shape[-1]}")
    unequal = [i for i, (lq, lkv) in enumerate(zip(call.layout.q_lens, call.layout.kv_lens)) if lq != lkv]
    if unequal:
        reasons.append(
            f"sequences {unequal[:4]} have unequal query and key counts, which FlashInfer 0.7.4's fmha-v2 "
            "gets wrong (wrong values or NaNs, measured on H200)"
        )
    sm = device_sm(call.q.device)
    if call.skip_factor is not None and sm not in SKIP_SMS:
        reasons.append(f"FlashInfer builds fmha-v2 skip-softmax kernels for SM90 only, this GPU is sm_{sm}")
    jit = _flashinfer.jit_missing_reason(uri)
    if jit:
        reasons.append(jit)
    return reasons


class FmhaV2Route(MeasuredDenseOrder, Route):
    name = "fmha-v2"
    caps = Capabilities(
        sms=frozenset({90, 120}),
        head_dims=frozenset({64, 128, 256}),
        skip_softmax=True,
        grouped_query=False,  # NaNs with FlashInfer 0.7.4 (measured on H200)
    )

    def extra_reasons(self, call: AttentionCall) -> list[str]:
        return fmha_v2_reasons(call, module_uri(call.q.dtype))

    def priority(self, call: AttentionCall) -> float:
        if call.skip_factor is not None and device_sm(call.q.device) in SKIP_SMS:
            return PREFERRED  # the fastest skip-softmax kernel on Hopper
        return super().priority(call)

    def run(self, call: AttentionCall) -> AttentionResult:
        qkv = (call.q.contiguous(), call.k.contiguous(), call.v.contiguous())
        out = prefill(qkv, "SEPARATE_Q_K_V", call, module_uri(call.q.dtype), bmm1_scale=call.softmax_scale)
        return AttentionResult(out, self.name)


def prefill(
    qkv: tuple[torch.Tensor, ...],
    input_layout: str,
    call: AttentionCall,
    uri: str,
    *,
    bmm1_scale: float,
    bmm2_scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One ``trtllm_fmha_v2_prefill`` call over ``call``'s ragged batch: non-causal, skip factor from ``call``."""
    fi = _flashinfer.flashinfer_or_none()
    layout = call.layout
    _flashinfer.announce_jit(uri)
    return fi.prefill.trtllm_fmha_v2_prefill(
        qkv,
        input_layout,
        _flashinfer.flashinfer_workspace(call.q.device),
        seq_lens=layout.seq_lens_kv,
        max_q_len=layout.max_seqlen_q,
        max_kv_len=layout.max_seqlen_kv,
        bmm1_scale=bmm1_scale,
        bmm2_scale=bmm2_scale,
        batch_size=layout.num_seqs,
        cum_seq_lens_q=layout.cu_seqlens_q,
        cum_seq_lens_kv=layout.cu_seqlens_kv,
        out_dtype=out_dtype,
        mask_mode="padding",
        skip_softmax_threshold_scale_factor=call.skip_factor or 0.0,
    )


register_route(FmhaV2Route())
