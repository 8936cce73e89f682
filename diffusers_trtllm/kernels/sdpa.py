"""``sdpa`` route: ``torch.nn.functional.scaled_dot_product_attention`` on any device.

Dense only. Ragged batches run padded to the longest sequence with a key-padding mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..routing.registry import AttentionCall, AttentionResult, Capabilities, Route, register_route


def pad_index(lens: tuple[int, ...], max_len: int, device: torch.device) -> torch.Tensor:
    """Flat ``[num_seqs * max_len]`` slot of every packed token."""
    idx = [torch.arange(n, device=device) + i * max_len for i, n in enumerate(lens)]
    return torch.cat(idx)


class SdpaRoute(Route):
    name = "sdpa"
    caps = Capabilities(
        device_types=frozenset({"cuda", "cpu"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    )

    def run(self, call: AttentionCall) -> AttentionResult:
        layout, q, k, v = call.layout, call.q, call.k, call.v
        n = layout.num_seqs
        gqa = k.shape[1] != q.shape[1]
        if len(set(layout.q_lens)) == 1 and len(set(layout.kv_lens)) == 1:
            qb = q.reshape(n, layout.q_lens[0], *q.shape[1:]).transpose(1, 2)
            kb = k.reshape(n, layout.kv_lens[0], *k.shape[1:]).transpose(1, 2)
            vb = v.reshape(n, layout.kv_lens[0], *v.shape[1:]).transpose(1, 2)
            out = F.scaled_dot_product_attention(qb, kb, vb, scale=call.softmax_scale, enable_gqa=gqa)
            return AttentionResult(out.transpose(1, 2).reshape(q.shape[0], q.shape[1], v.shape[-1]), self.name)
        mq, mkv = layout.max_seqlen_q, layout.max_seqlen_kv
        q_slots = pad_index(layout.q_lens, mq, q.device)
        kv_slots = pad_index(layout.kv_lens, mkv, q.device)

        def padded(x: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
            full = x.new_zeros(n * length, *x.shape[1:])
            full.index_copy_(0, slots, x)
            return full.reshape(n, length, *x.shape[1:]).transpose(1, 2)

        kv_valid = torch.zeros(n * mkv, dtype=torch.bool, device=q.device)
        kv_valid[kv_slots] = True
        out = F.scaled_dot_product_attention(
            padded(q, q_slots, mq),
            padded(k, kv_slots, mkv),
            padded(v, kv_slots, mkv),
            attn_mask=kv_valid.reshape(n, 1, 1, mkv),
            scale=call.softmax_scale,
            enable_gqa=gqa,
        )
        out = out.transpose(1, 2).reshape(n * mq, q.shape[1], v.shape[-1]).index_select(0, q_slots)
        return AttentionResult(out, self.name)


register_route(SdpaRoute())
