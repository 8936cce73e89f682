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
go to another route. Ring attention's KV shards qualify: Diffusers splits queries and keys
alike, so every shard has as many keys as the rank has queries.

The log-sum-exp (``return_lse``, ring attention) comes from the kernel's softmax stats,
``save_softmax_stats=True``, read from FlashInfer 0.7.4's source (paths under
``flashinfer/data/csrc/``; our reading, the GPU test ``test_fmha_v2_lse_matches_reference``
checks it):

- Asked in ``SEPARATE_Q_K_V``, the host code prints a message and ends the process
  (``fmha_v2_run.cu``, the check after "Validation for softmax save with MLA": plain attention
  saves stats only in ``CONTIGUOUS_Q_KV``). So a call that wants the LSE runs in that layout, K
  and V stacked into one ``[tokens, 2, heads, dim]`` tensor (a copy), a second JIT module.
- ``stats`` is ``[q_tokens, heads, 2]`` float32: ``[..., 0]`` the row max, ``[..., 1]`` the row
  sum (``Softmax_saver_tma`` in ``fmha/hopper/fragment.h``: max at the row's offset, sum one float
  after). The SM90 warp-specialized kernels (``fmha/warpspec/compute.h``, the end of the q-step
  loop) store ``p_max / sqrt(head_dim)`` and ``p_sum``.
- Without ALiBi or soft-capping (our calls) the kernels use the exp2 path: the host passes
  ``bmm1_scale * log2(e)`` (``fmha_v2_run.cu``, ``set_params``), the logits stay unscaled in the
  softmax (``Softmax_fp32_base::unpack`` in ``fmha/warpspec/epilogue.h``), so ``p_max`` is the row
  max ``m`` of the raw products ``q . k`` and ``p_sum = sum_j exp(bmm1_scale * (s_j - m))``
  (``compute_and_update_scale``). The stored max is ``m / sqrt(head_dim)`` whatever
  ``bmm1_scale`` is, hence ``lse = bmm1_scale * sqrt(head_dim) * stats[..., 0] + ln(stats[..., 1])``
  in natural-log units of the scaled logits (``softmax_stats_to_lse``), as fa3 and triton give it.
- The e4m3 kernels scale probabilities by fp8's range before P.V; with stats on, their epilogue
  multiplies the sum back (``Tile_o_epilogue<Hopper_qgmma_e4m3_fp32_traits>::scale``), so the same
  formula holds with ``bmm1_scale`` including the dequantization (``fmha_v2_fp8``).
- Skip-softmax: a skipped KV step returns before the max and sum are updated, so its keys are
  left out of the LSE, as ``AttentionResult.lse`` documents.
- The SM120 kernels store the max unscaled by ``sqrt(head_dim)`` (``Softmax_saver`` in
  ``fmha/fragment.h``); they are not tested here, so the LSE is served on SM90 only.
"""

from __future__ import annotations

import math

import torch

from ..routing.registry import AttentionCall, AttentionResult, Capabilities, Route, device_sm, register_route
from . import flashinfer_support

__all__ = ["FmhaV2Route", "SKIP_SMS", "kv_step", "Q_STEP", "prefill", "fmha_v2_reasons", "softmax_stats_to_lse"]

#: SMs whose FMHAv2 kernels FlashInfer builds with skip-softmax.
SKIP_SMS = frozenset({90})
#: Query rows that vote together on skipping a KV step (one SM90 warpgroup).
Q_STEP = 64
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def kv_step(head_dim: int) -> int:
    """Keys per KV step of the SM90 bf16/fp16 kernels (FlashInfer's ``kv_loop_step``)."""
    return 256 if head_dim <= 64 else 128 if head_dim <= 128 else 64


def input_layout(call: AttentionCall) -> str:
    """``CONTIGUOUS_Q_KV`` for a call that wants the LSE (the only layout that saves stats), else
    ``SEPARATE_Q_K_V`` (no K/V copy)."""
    return "CONTIGUOUS_Q_KV" if call.return_lse else "SEPARATE_Q_K_V"


def module_uri(dtype: torch.dtype, layout: str = "SEPARATE_Q_K_V") -> str:
    """Name of FlashInfer's JIT module for this layout and dtype (one module holds every head dim)."""
    name = _DTYPE_NAMES[dtype]
    return f"trtllm_fmha_v2_{layout.lower()}_{name}_{name}"


def fmha_v2_reasons(call: AttentionCall, uri: str | None) -> list[str]:
    """Why FlashInfer's fmha-v2 (JIT module ``uri``; None: no module for this dtype, which the capability
    table reports) cannot serve ``call``, beyond the capability table."""
    missing = flashinfer_support.flashinfer_missing_reason()
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
    if call.return_lse and sm != 90:
        reasons.append(f"fmha-v2's log-sum-exp is read from the SM90 kernels' softmax stats, this GPU is sm_{sm}")
    jit = flashinfer_support.jit_missing_reason(uri) if uri is not None else None
    if jit:
        reasons.append(jit)
    return reasons


class FmhaV2Route(Route):
    name = "fmha-v2"
    caps = Capabilities(
        sms=frozenset({90, 120}),
        head_dims=frozenset({64, 128, 256}),
        skip_softmax=True,
        grouped_query=False,  # NaNs with FlashInfer 0.7.4 (measured on H200)
        lse=True,  # SM90 only (fmha_v2_reasons)
    )

    def extra_reasons(self, call: AttentionCall) -> list[str]:
        uri = module_uri(call.q.dtype, input_layout(call)) if call.q.dtype in _DTYPE_NAMES else None
        return fmha_v2_reasons(call, uri)

    def run(self, call: AttentionCall) -> AttentionResult:
        layout = input_layout(call)
        if layout == "CONTIGUOUS_Q_KV":
            qkv = (call.q.contiguous(), torch.stack((call.k, call.v), dim=1))
        else:
            qkv = (call.q.contiguous(), call.k.contiguous(), call.v.contiguous())
        out, lse = prefill(qkv, layout, call, module_uri(call.q.dtype, layout), bmm1_scale=call.softmax_scale)
        return AttentionResult(out, self.name, lse=lse)


def prefill(
    qkv: tuple[torch.Tensor, ...],
    input_layout: str,
    call: AttentionCall,
    uri: str,
    *,
    bmm1_scale: float,
    bmm2_scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One ``trtllm_fmha_v2_prefill`` call over ``call``'s ragged batch: non-causal, skip factor from ``call``.

    Returns the output and, when ``call.return_lse``, each row's ``[q_tokens, heads]`` log-sum-exp of the
    logits ``bmm1_scale * q . k`` (else None).
    """
    fi = flashinfer_support.flashinfer_or_none()
    layout = call.layout
    flashinfer_support.announce_jit(uri)
    lse_arg = {"save_softmax_stats": True} if call.return_lse else {}
    res = fi.prefill.trtllm_fmha_v2_prefill(
        qkv,
        input_layout,
        flashinfer_support.flashinfer_workspace(call.q.device),
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
        **lse_arg,
    )
    if not call.return_lse:
        return res, None
    out, stats = res
    return out, softmax_stats_to_lse(stats, bmm1_scale, call.q.shape[-1])


def softmax_stats_to_lse(stats: torch.Tensor, bmm1_scale: float, head_dim: int) -> torch.Tensor:
    """FMHAv2's ``[tokens, heads, 2]`` softmax stats (SM90: row max of ``q . k`` over ``sqrt(head_dim)``,
    row sum of ``exp(bmm1_scale * (s - max))``) as the natural log-sum-exp of the logits ``bmm1_scale * s``."""
    return stats[..., 0] * (bmm1_scale * math.sqrt(head_dim)) + torch.log(stats[..., 1])


register_route(FmhaV2Route())
