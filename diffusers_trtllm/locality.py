"""Local self-attention in a random-weight model, so that skip-softmax has tiles to skip.

Random weights give flat attention, where skip-softmax skips nothing. ``make_attention_local``
makes self-attention local: every Q/K projection of a self/joint attention module gets one
large shared bias, so after QK-norm all tokens' queries and keys point the same way and RoPE
alone sets the score, ``sum_pairs a_p cos(omega_p * distance)``: highest at distance 0 and
falling with distance. The demo and ``calibrate()``'s tests build such models; the benchmark's
structured weights are ``local_attention``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch

from .serving.roles import guess_role

__all__ = ["make_attention_local", "local_attention", "SHARED_BIAS_RMS"]


#: RMS of the shared Q/K bias per element; the token-dependent part W x has RMS about 0.6
#: (default Linear init on unit-RMS activations), so after QK-norm it is ~7% of each vector.
SHARED_BIAS_RMS = 8.0
_QK_PROJECTIONS = ("to_q", "to_k", "add_q_proj", "add_k_proj")
_QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


@torch.no_grad()
def make_attention_local(
    model: torch.nn.Module, contrast: float, *, seed: int = 0, spread: float = 0.0
) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Make self/joint attention of ``model`` local, in place.

    Returns the number of attention modules changed and ``(parameter, original value)`` pairs.

    Every self/joint attention module gets one random shared vector ``s`` as the bias of
    all its Q and K projections, and QK-norm weights ``g = sqrt(contrast / sqrt(head_dim))``,
    so two tokens at RoPE distance 0 score about ``contrast`` nats (``g**2 * sqrt(head_dim)``),
    and the part of the score that varies with distance (RoPE's faster frequencies) is a
    fraction of that. Larger ``contrast``: sharper attention, more tiles skipped at a
    threshold (``python -m diffusers_trtllm.bench e2e --probe`` measures it). ``spread`` scales
    ``s`` per head from ``1 - spread`` to ``1 + spread``, so heads differ in reach (a smoother
    sparsity-versus-threshold curve). Cross-attention and text refiners (HunyuanVideo's: text
    tokens only, no RoPE) are left alone.
    """
    if contrast <= 0:
        raise ValueError(f"contrast must be > 0 nats; got {contrast!r}.")
    if not 0.0 <= spread < 1.0:
        raise ValueError(f"spread must be in [0, 1); got {spread!r}.")
    gen = torch.Generator().manual_seed(seed)
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    changed = 0
    for name, module in model.named_modules():
        if not (hasattr(module, "to_q") and hasattr(module, "to_k") and hasattr(module, "heads")):
            continue
        if guess_role(name, module) in ("cross", "refiner"):  # text keys only, no RoPE: nothing to make local
            continue
        inner = module.to_q.out_features
        head_dim = inner // module.heads
        norms = [getattr(module, n) for n in _QK_NORMS if getattr(module, n, None) is not None]
        if not norms or any(getattr(n, "weight", None) is None for n in norms):
            raise ValueError(
                f"{name} ({type(module).__name__}) has no QK-norm weights: local_attention sets the score's "
                "scale through them. Use a family with QK-norm (Wan, Flux) or the random weights."
            )
        shared = torch.randn(inner, generator=gen) * SHARED_BIAS_RMS
        if spread:
            shared *= torch.linspace(1.0 - spread, 1.0 + spread, module.heads).repeat_interleave(head_dim)
        gain = math.sqrt(contrast / math.sqrt(head_dim))
        for proj in (getattr(module, p, None) for p in _QK_PROJECTIONS):
            if proj is None:
                continue
            if proj.bias is None or proj.out_features != inner:
                raise ValueError(f"{name}: a Q/K projection without a bias of size {inner}; cannot add the shared bias.")
            saved.append((proj.bias, proj.bias.detach().clone()))
            proj.bias.copy_(shared)
        for norm in norms:
            saved.append((norm.weight, norm.weight.detach().clone()))
            norm.weight.fill_(gain)
        changed += 1
    if not changed:
        raise ValueError(f"{type(model).__name__} has no self/joint attention module with to_q/to_k projections.")
    return changed, saved


@contextlib.contextmanager
def local_attention(model: torch.nn.Module, contrast: float, *, seed: int = 0) -> Iterator[int]:
    """Inside the block, ``make_attention_local(model, contrast)`` holds; the weights are restored after.

    Yields the number of attention modules changed.
    """
    changed, saved = make_attention_local(model, contrast, seed=seed)
    try:
        yield changed
    finally:
        for param, value in saved:
            param.data.copy_(value)
