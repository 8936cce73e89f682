"""``fmha-v2-fp8`` route: TRT-LLM's FMHAv2 in fp8 e4m3 on Hopper, with skip-softmax.

Serves ``quant={"dtype_qk": "fp8_e4m3"}`` (with or without skip-softmax) on SM90
through ``flashinfer.prefill.trtllm_fmha_v2_prefill`` in the ``CONTIGUOUS_Q_KV``
layout (``SEPARATE_Q_K_V`` refuses fp8) with a bf16/fp16 output. The kernel takes
its dequantization as two host floats, so Q and K get one scale per tensor
(``fp8_tensor_quant``: K and V smoothed, V scaled per channel and restored after
the kernel) instead of SAGE's per-block scales: ``q_block_size`` and
``k_block_size`` do not apply here. fp8's three mantissa bits, not the scale
granularity, set the error (docs/design.md, "fp8 on FMHAv2", has the measurement);
``backend="auto"`` tries this route first for fp8 SAGE on SM90 (``routing.order``) because it is
the fastest and, measured there, as accurate as the per-block emulation. The skip rule is fmha-v2's;
its tiles are 64 query rows x ``kv_step(head_dim)`` keys (FlashInfer 0.7.4's e4m3 kernels
step 256 keys up to head dim 128: ``jit/attention/fmha_v2/fmha_library.py``,
``generate_kernel_spec``).

The log-sum-exp (ring attention) comes from the kernel's softmax stats as in ``fmha_v2``
(its docstring has the reading of FlashInfer's source), with ``bmm1_scale`` including Q's and
K's dequantization; K's smoothing moved every logit of a row by ``-softmax_scale * q . mean``,
which ``restore_lse`` adds back, so KV shards quantized apart still merge.
"""

from __future__ import annotations

import torch

from ..routing.registry import AttentionCall, AttentionResult, Capabilities, Route, register_route
from . import fmha_v2
from .fp8_tensor_quant import quantize_fp8_per_tensor, restore_lse, restore_output

__all__ = ["FmhaV2Fp8Route", "kv_step", "module_uri"]

_OUT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def kv_step(head_dim: int) -> int:
    """Keys per KV step of the SM90 e4m3 kernels (FlashInfer's ``kv_loop_step``)."""
    return 256 if head_dim <= 128 else 128


def module_uri(out_dtype: torch.dtype) -> str:
    """FlashInfer's JIT module for e4m3 inputs in ``CONTIGUOUS_Q_KV`` with this output dtype."""
    return f"trtllm_fmha_v2_contiguous_q_kv_e4m3_{_OUT_NAMES[out_dtype]}"


class FmhaV2Fp8Route(Route):
    name = "fmha-v2-fp8"
    caps = Capabilities(
        sms=frozenset({90}),  # FlashInfer refuses e4m3 FMHAv2 on SM120
        head_dims=frozenset({64, 128, 256}),
        skip_softmax=True,
        sage_dtypes=frozenset({"fp8_e4m3"}),
        grouped_query=False,  # the bf16 kernels gave NaNs with grouped-query heads (measured on H200)
        lse=True,
    )

    def extra_reasons(self, call: AttentionCall) -> list[str]:
        reasons = [] if call.quant is not None else ["serves fp8 SAGE calls only (quant dtype_qk='fp8_e4m3')"]
        uri = module_uri(call.q.dtype) if call.q.dtype in _OUT_NAMES else None
        return reasons + fmha_v2.fmha_v2_reasons(call, uri)

    def run(self, call: AttentionCall) -> AttentionResult:
        quant = quantize_fp8_per_tensor(call.q, call.k, call.v)
        out, lse = fmha_v2.prefill(
            (quant.q, quant.kv),
            "CONTIGUOUS_Q_KV",
            call,
            module_uri(call.q.dtype),
            bmm1_scale=call.softmax_scale * quant.qk_scale,
            out_dtype=call.q.dtype,
        )
        if lse is not None:
            lse = restore_lse(lse, call.q, quant, call.softmax_scale)
        return AttentionResult(restore_output(out, quant), self.name, lse=lse)


register_route(FmhaV2Fp8Route())
