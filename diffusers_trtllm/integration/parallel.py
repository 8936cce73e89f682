"""Diffusers' context parallelism (Ulysses) running our attention on each rank's heads.

Under Ulysses, Diffusers exchanges every rank's ``[B, S/n, H, D]`` slice for the whole
sequence of ``H/n`` heads (all-to-all), calls a backend's forward op on it, and exchanges
the output back. We hand its ``TemplatedUlyssesAttention`` a forward op that runs our
custom op: each rank sees every key of its heads, so skip-softmax and SAGE behave exactly
as on one process. Ring attention (per-shard outputs merged by log-sum-exp) keeps the stock
path. See docs/design.md, "Context parallelism".
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["served_ulysses_degree", "ulysses_attention"]

#: ``run(query, key, value, attn_mask)`` on the exchanged ``[B, S, H/n, D]`` tensors.
ShardAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def _templated_ulysses() -> Any:
    try:
        from diffusers.models.attention_dispatch import TemplatedUlyssesAttention
    except ImportError:  # a Diffusers without context parallelism
        return None
    return TemplatedUlyssesAttention


def served_ulysses_degree(parallel_config: Any) -> Optional[int]:
    """The Ulysses degree of a call we serve under ``parallel_config``, else None (the call stays stock).

    Served: Ulysses alone (``ring_degree == 1``), with heads and sequence split evenly (not
    ``ulysses_anything``). Ring and Ulysses x ring need each KV shard's log-sum-exp.
    """
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None or _templated_ulysses() is None:
        return None
    if cp.ring_degree != 1 or cp.ulysses_degree <= 1 or getattr(cp, "ulysses_anything", False):
        return None
    return int(cp.ulysses_degree)


def ulysses_attention(run: ShardAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: Optional[torch.Tensor], scale: Optional[float], parallel_config: Any) -> torch.Tensor:
    """``[B, S/n, H, D]`` attention of this rank's slice, computed by ``run`` on ``[B, S, H/n, D]`` per rank."""

    def forward_op(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                   _save_ctx=True, _parallel_config=None):
        if return_lse:
            raise RuntimeError("diffusers_trtllm: the Ulysses forward op returns no log-sum-exp; "
                               "call it with return_lse=False (ring attention keeps the stock path).")
        return run(query, key, value, attn_mask)

    # Served calls run without autograd (see intercept._servable_arguments), so no backward op is needed.
    return _templated_ulysses().apply(query, key, value, attn_mask, 0.0, False, scale, False, False, forward_op, None,
                                      parallel_config)
