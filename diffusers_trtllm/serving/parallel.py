"""Diffusers' context parallelism (Ulysses, ring, Ulysses x ring) running our attention on each rank.

Diffusers runs a parallel attention call through templated autograd functions that call a
backend's forward op on each rank's tensors:

- Ulysses exchanges every rank's ``[B, S/n, H, D]`` slice for the whole sequence of ``H/n``
  heads (all-to-all), calls the op once and exchanges the output back. Each rank sees every
  key of its heads, so skip-softmax and SAGE behave exactly as on one process.
- Ring all-gathers K and V and calls the op once per KV shard (its own first) with
  ``return_lse=True``; the partial outputs merge by their log-sum-exp. Our op runs the route on
  that shard alone: the skip rule's running max is local to the shard (its first tile is never
  skipped), ``lambda`` is the one-process value.
- Ulysses x ring: the Ulysses exchange, then ring over the exchanged tensors.

We hand Diffusers' dispatcher for these (``_templated_context_parallel_attention``) a forward op
that calls ours. Uneven splits (``*_anything``) keep the stock path. See docs/design.md,
"Context parallelism".
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import torch

__all__ = ["Degrees", "served_degrees", "context_parallel_attention"]

#: ``run(query, key, value, attn_mask, return_lse)`` on one rank's exchanged tensors: the output,
#: or ``(output, lse)`` with ``lse`` ``[B, S, H]`` float32 when ``return_lse`` (a ring KV shard).
ShardAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], bool],
                          Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]


class Degrees(NamedTuple):
    ulysses: int
    ring: int


def _templated_attention() -> Any:
    try:
        from diffusers.models.attention_dispatch import _templated_context_parallel_attention
    except ImportError:  # a Diffusers without context parallelism
        return None
    return _templated_context_parallel_attention


def served_degrees(parallel_config: Any) -> Optional[Degrees]:
    """The Ulysses and ring degrees of a call we serve under ``parallel_config``, else None (stock).

    Served: Ulysses, ring and both, with heads and sequence split evenly (not ``ulysses_anything``
    nor ``ring_anything``).
    """
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None or _templated_attention() is None:
        return None
    degrees = Degrees(int(cp.ulysses_degree), int(cp.ring_degree))
    if degrees.ulysses * degrees.ring <= 1:
        return None
    if getattr(cp, "ulysses_anything", False) or getattr(cp, "ring_anything", False):
        return None
    return degrees


def context_parallel_attention(run: ShardAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attn_mask: Optional[torch.Tensor], scale: Optional[float],
                               parallel_config: Any) -> torch.Tensor:
    """``[B, S/n, H, D]`` attention of this rank's slice, Diffusers' exchanges around ``run``."""

    def forward_op(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                   _save_ctx=True, _parallel_config=None):
        return run(query, key, value, attn_mask, return_lse)

    # Served calls run without autograd (see intercept._servable_arguments), so no backward op is needed.
    return _templated_attention()(query, key, value, attn_mask, 0.0, False, scale, False, False,
                                  forward_op=forward_op, backward_op=None, _parallel_config=parallel_config)
