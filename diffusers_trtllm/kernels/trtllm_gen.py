"""``trtllm-gen`` route: FlashInfer's TRT-LLM kernels for Blackwell (SM100/103/107).

Dense, skip-softmax and SAGE through ``flashinfer.prefill.trtllm_ragged_attention_deepseek``,
with Q/K/V quantized by ``flashinfer.trtllm_sage_attention_quantize``. Called with
the arguments vLLM-Omni's ``TRTLLM_ATTN`` backend passes. Not run on hardware by
this project (no Blackwell GPU was available); its contract is tested on the CPU.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from ..config import BLOCK_SIZES, DEFAULT_K_BLOCK
from ..routing.registry import AttentionCall, AttentionResult, Capabilities, Route, device_sm, register_route
from . import flashinfer_support

#: SM numbers of the trtllm-gen cubins shipped by FlashInfer.
BLACKWELL_SMS = frozenset({100, 103, 107})
#: int8 SAGE cubins exist for SM100 only; the other Blackwell parts take fp8 e4m3.
INT8_SAGE_SMS = frozenset({100})


def _attention_fn() -> Callable[..., torch.Tensor]:
    return flashinfer_support.flashinfer_or_none().prefill.trtllm_ragged_attention_deepseek


def _quantize_fn() -> Callable[..., tuple[torch.Tensor, ...]] | None:
    return getattr(flashinfer_support.flashinfer_or_none(), "trtllm_sage_attention_quantize", None)


@functools.lru_cache(maxsize=8)  # route selection asks on every call; the signature never changes
def _accepts_sage(fn: Callable[..., Any]) -> bool:
    try:
        return "sage_attn_sfs" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _row_activity(q_lens: tuple[int, ...], kv_lens: tuple[int, ...]) -> dict[str, Any]:
    """Tell FlashInfer whether every sequence is non-empty, from host lengths (no device sync).

    With all rows active the kernel's empty-row scan is skipped; otherwise the
    host mirrors let it compact the empty rows (skipping the scan then is undefined).
    """
    if min(q_lens) > 0 and min(kv_lens) > 0:
        return {"skip_all_rows_active_check": True}
    return {
        "q_seq_lens_cpu": torch.tensor(q_lens, dtype=torch.int32),
        "kv_seq_lens_cpu": torch.tensor(kv_lens, dtype=torch.int32),
    }


class TrtllmGenRoute(Route):
    name = "trtllm-gen"
    caps = Capabilities(
        sms=BLACKWELL_SMS,
        head_dims=frozenset({128, 256}),
        skip_softmax=True,
        sage_dtypes=frozenset({"int8", "fp8_e4m3"}),
        grouped_query=False,
    )

    def extra_reasons(self, call: AttentionCall) -> list[str]:
        missing = flashinfer_support.flashinfer_missing_reason()
        if missing:
            return [missing]
        reasons = []
        if call.quant is not None:
            if call.quant.dtype_qk == "int8" and device_sm(call.q.device) not in INT8_SAGE_SMS:
                reasons.append(f"int8 SAGE needs SM in {sorted(INT8_SAGE_SMS)}; use dtype_qk='fp8_e4m3'")
            if call.quant.k_block_size not in (None, *BLOCK_SIZES):
                reasons.append(f"FlashInfer's SAGE kernels take k_block_size in {BLOCK_SIZES}, "
                               f"not {call.quant.k_block_size}")
            if _quantize_fn() is None or not _accepts_sage(_attention_fn()):
                reasons.append("this FlashInfer build has no SAGE kernels (need flashinfer-python>=0.6.18)")
        return reasons

    def run(self, call: AttentionCall) -> AttentionResult:
        layout = call.layout
        q, k, v = call.q.contiguous(), call.k.contiguous(), call.v.contiguous()
        sage: dict[str, Any] = {}
        if call.quant is not None:
            quant = call.quant.with_k_block(DEFAULT_K_BLOCK)
            quantized = _quantize_fn()(
                q,
                k,
                v,
                q_block_size=quant.q_block_size,
                k_block_size=quant.k_block_size,
                qk_quant_dtype=quant.qk_dtype,
                cum_seq_lens_q=layout.cu_seqlens_q,
                cum_seq_lens_kv=layout.cu_seqlens_kv,
                smooth_k=quant.smooth_k,
            )
            # With smooth_k a seventh output (K's mean) follows; softmax does not need it.
            q, k, v, q_scale, k_scale, v_scale = quantized[:6]
            sage = {
                "sage_attn_sfs": (q_scale, k_scale, None, v_scale),
                "num_elts_per_sage_attn_blk": (quant.q_block_size, quant.k_block_size, 0, 1),
            }
        out = _attention_fn()(
            query=q,
            key=k,
            value=v,
            workspace_buffer=flashinfer_support.flashinfer_workspace(q.device),
            seq_lens=layout.seq_lens_kv,
            max_q_len=layout.max_seqlen_q,
            max_kv_len=layout.max_seqlen_kv,
            bmm1_scale=call.softmax_scale,
            bmm2_scale=1.0,
            o_sf_scale=-1.0,
            batch_size=layout.num_seqs,
            window_left=-1,
            cum_seq_lens_q=layout.cu_seqlens_q,
            cum_seq_lens_kv=layout.cu_seqlens_kv,
            enable_pdl=False,
            is_causal=False,
            return_lse=False,
            skip_softmax_threshold_scale_factor=call.skip_factor,
            **_row_activity(layout.q_lens, layout.kv_lens),
            **sage,
        )
        return AttentionResult(out.to(call.q.dtype), self.name)


register_route(TrtllmGenRoute())
