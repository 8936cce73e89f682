"""``fa3`` route: FlashInfer's FlashAttention-3 prefill kernels (``backend="fa3"``), dense, SM90.

The fastest dense kernel measured on the H200 for most shapes (README, Hopper). One
sequence goes to ``single_prefill_with_kv_cache`` (no planning); a ragged batch
to ``BatchPrefillWithRaggedKVCacheWrapper``, planned once per layout from the
host-side lengths (no device sync) and kept for the next layers of the same forward.
Each head dim and dtype is its own JIT module (about 90 s to build, once).

On request (ring attention) both return each row's log-sum-exp (``return_lse=True``):
FlashInfer's is in log2 units (vLLM merges it with ``is_lse_base_on_e=False``), so it is
scaled by ``ln 2`` to the natural log ring attention merges by.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from itertools import accumulate
from typing import Any

import torch

from ..layout import PackedLayout
from ..routing.registry import AttentionCall, AttentionResult, Capabilities, Route, register_route
from . import flashinfer_support

__all__ = ["Fa3Route"]

#: Planned ragged wrappers kept (a transformer forward alternates a few layouts).
_MAX_PLANS = 4
_plans: "OrderedDict[tuple, tuple[PackedLayout, Any]]" = OrderedDict()


def module_uri(call: AttentionCall) -> str:
    """FlashInfer's name for the module this call needs (single- or batch-prefill, dtype, head dim)."""
    return _module_uri(call.q.shape[-1], call.q.dtype, call.layout.num_seqs == 1)


@functools.lru_cache(maxsize=None)
def _module_uri(dim: int, dtype: torch.dtype, single: bool) -> str:
    """``module_uri``'s name, built once (asked on every call)."""
    from flashinfer.jit.attention.modules import get_batch_prefill_uri, get_single_prefill_uri

    common = (dim, dim, 0, False, False, False)  # head dims qk/vo, no pos. encoding / window / soft cap / fp16 qk
    if single:
        return get_single_prefill_uri("fa3", dtype, dtype, dtype, *common)
    return get_batch_prefill_uri("fa3", dtype, dtype, dtype, torch.int32, *common)


def _ragged_wrapper(call: AttentionCall) -> Any:
    layout, (_, heads, dim), kv_heads = call.layout, call.q.shape, call.k.shape[1]
    key = (id(layout), call.q.device, call.q.dtype, heads, kv_heads, dim, call.softmax_scale)
    hit = _plans.get(key)
    if hit is not None and hit[0] is layout:
        _plans.move_to_end(key)
        return hit[1]
    fi = flashinfer_support.flashinfer_or_none()
    wrapper = fi.prefill.BatchPrefillWithRaggedKVCacheWrapper(
        flashinfer_support.flashinfer_workspace(call.q.device), kv_layout="NHD", backend="fa3"
    )
    host = {  # host copies of cu_seqlens from the host-side lengths: planning needs no device sync
        name: torch.tensor([0, *accumulate(lens)], dtype=torch.int32)
        for name, lens in (("qo_indptr_cpu", layout.q_lens), ("kv_indptr_cpu", layout.kv_lens))
    }
    wrapper.plan(
        layout.cu_seqlens_q,
        layout.cu_seqlens_kv,
        heads,
        kv_heads,
        dim,
        causal=False,
        sm_scale=call.softmax_scale,
        q_data_type=call.q.dtype,
        kv_data_type=call.k.dtype,
        **host,
    )
    _plans[key] = (layout, wrapper)  # the layout is held so its id cannot be reused while cached
    if len(_plans) > _MAX_PLANS:
        _plans.popitem(last=False)
    return wrapper


class Fa3Route(Route):
    name = "fa3"
    caps = Capabilities(sms=frozenset({90}), head_dims=frozenset({64, 128, 256}), lse=True)

    def extra_reasons(self, call: AttentionCall) -> list[str]:
        missing = flashinfer_support.flashinfer_missing_reason()
        if missing:
            return [missing]
        if call.v.shape[-1] != call.q.shape[-1]:
            return [f"value head dim {call.v.shape[-1]} differs from query head dim {call.q.shape[-1]}"]
        if call.q.dtype not in self.caps.dtypes:
            return []  # no module to build for this dtype (the capability table says so)
        jit = flashinfer_support.jit_missing_reason(module_uri(call))
        return [jit] if jit else []

    def run(self, call: AttentionCall) -> AttentionResult:
        flashinfer_support.announce_jit(module_uri(call), seconds=90)
        q, k, v = call.q.contiguous(), call.k.contiguous(), call.v.contiguous()
        lse_arg = {"return_lse": True} if call.return_lse else {}
        if call.layout.num_seqs == 1:
            fi = flashinfer_support.flashinfer_or_none()
            res = fi.single_prefill_with_kv_cache(
                q, k, v, causal=False, kv_layout="NHD", sm_scale=call.softmax_scale, backend="fa3", **lse_arg
            )
        else:
            res = _ragged_wrapper(call).run(q, k, v, **lse_arg)
        if not call.return_lse:
            return AttentionResult(res, self.name)
        out, lse2 = res
        return AttentionResult(out, self.name, lse=lse2.float() * math.log(2.0))


register_route(Fa3Route())
