"""A CPU stand-in for ``flashinfer.prefill.trtllm_fmha_v2_prefill`` (FlashInfer 0.7.4's signature and contract).

Computes what the SM90 kernels compute, per sequence in fp32: ``softmax(bmm1_scale * q @ k^T) @ v * bmm2_scale``,
and with ``save_softmax_stats=True`` returns ``(out, stats)``, stats ``[q_tokens, heads, 2]`` float32 holding
the row max of ``q . k`` over ``sqrt(head_dim)`` and the row sum of ``exp(bmm1_scale * (s - max))``, as
``Softmax_saver_tma`` stores them (``fmha_v2`` module docstring). Asking for stats in ``SEPARATE_Q_K_V`` raises
where FlashInfer's host code ends the process. Every call's arguments are appended to ``calls``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["fake_trtllm_fmha_v2_prefill"]


def fake_trtllm_fmha_v2_prefill(calls: list):
    def trtllm_fmha_v2_prefill(
        qkv, input_layout, workspace_buffer, seq_lens, max_q_len, max_kv_len, bmm1_scale, bmm2_scale,
        batch_size, cum_seq_lens_q, cum_seq_lens_kv, block_tables=None, out=None, out_dtype=None, sinks=None,
        pos_encoding_mode=None, logits_soft_cap_scale=None, mask_mode="causal", window_left=-1,
        chunked_attention_size=0, save_softmax_stats=False, skip_softmax_threshold_scale_factor=0,
    ):
        if input_layout == "SEPARATE_Q_K_V":
            q, k, v = qkv
            if save_softmax_stats:
                raise RuntimeError("FlashInfer 0.7.4 exits the process: stats need CONTIGUOUS_Q_KV")
        else:
            assert input_layout == "CONTIGUOUS_Q_KV"
            q, kv = qkv
            assert kv.ndim == 4 and kv.shape[1] == 2 and kv.is_contiguous()
            k, v = kv[:, 0], kv[:, 1]
        assert mask_mode == "padding" and q.is_contiguous()
        assert isinstance(bmm1_scale, float) and isinstance(max_q_len, int) and isinstance(max_kv_len, int)
        assert torch.equal(seq_lens, cum_seq_lens_kv[1:] - cum_seq_lens_kv[:-1]) and batch_size == len(seq_lens)
        assert k.shape[0] == int(cum_seq_lens_kv[-1])
        calls.append({"layout": input_layout, "bmm1_scale": bmm1_scale, "bmm2_scale": bmm2_scale,
                      "skip": skip_softmax_threshold_scale_factor, "out_dtype": out_dtype, "stats": save_softmax_stats})
        dtype = out_dtype or q.dtype
        result = torch.empty(q.shape, dtype=dtype)
        stats = torch.empty(*q.shape[:2], 2)
        for b in range(batch_size):
            qs, qe, ks, ke = (int(x) for x in (cum_seq_lens_q[b], cum_seq_lens_q[b + 1], cum_seq_lens_kv[b],
                                                cum_seq_lens_kv[b + 1]))
            raw = torch.einsum("qhd,khd->qhk", q[qs:qe].float(), k[ks:ke].float())
            row_max = raw.amax(-1)
            p = torch.exp(bmm1_scale * (raw - row_max[..., None]))
            stats[qs:qe, :, 0] = row_max / math.sqrt(q.shape[-1])
            stats[qs:qe, :, 1] = p.sum(-1)
            o = torch.einsum("qhk,khd->qhd", p / p.sum(-1, keepdim=True), v[ks:ke].float()) * bmm2_scale
            result[qs:qe] = o.to(dtype)
        return (result, stats) if save_softmax_stats else result

    return trtllm_fmha_v2_prefill
