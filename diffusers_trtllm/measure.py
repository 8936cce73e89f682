"""Accuracy and skip-softmax measurements: relative L1, cosine, and each tile's skip-critical value.

The library's own ``calibrate()`` and demo use them, and the benchmark reports them; they
live here so that the library never imports its benchmark.
"""

from __future__ import annotations

import math

import torch

__all__ = ["rel_l1", "cosine", "tile_criticals", "skipped_fraction", "threshold_for"]


def rel_l1(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``sum |out - ref| / sum |ref|`` in float64."""
    out, ref = out.double(), ref.double()
    return float((out - ref).abs().sum() / ref.abs().sum())


def cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0))


@torch.no_grad()
def tile_criticals(
    q: torch.Tensor, k: torch.Tensor, softmax_scale: float, tile_q: int, tile_kv: int
) -> torch.Tensor:
    """For one sequence ``[tokens, heads, dim]``: each tile's largest ``exp(local_max - running_max)``.

    Tile ``(i, j)`` with ``j > 0`` is skipped exactly when its value is below ``lambda``
    (the reference's rule). A skipped tile never raises the running max (its
    maximum lies below it), so the running max is the dense one and one pass
    gives the skipped fraction at every threshold. Returns ``[heads, n_q_tiles,
    n_kv_tiles - 1]`` float32 (tile 0, never skipped, left out).
    """
    q, k = q.float().transpose(0, 1), k.float().transpose(0, 1)  # [H, L, D]
    heads, lq, _ = q.shape
    lkv = k.shape[1]
    n_qt, n_kt = -(-lq // tile_q), -(-lkv // tile_kv)
    pad = n_qt * tile_q - lq
    crit = torch.empty(heads, n_qt, max(n_kt - 1, 0), device=q.device)
    m = torch.full((heads, lq), -math.inf, device=q.device)
    for j in range(n_kt):
        local = torch.matmul(q, k[:, j * tile_kv : (j + 1) * tile_kv].transpose(1, 2)).amax(dim=-1) * softmax_scale
        if j > 0:
            ratio = torch.nn.functional.pad(torch.exp(local - m), (0, pad), value=0.0)
            crit[:, :, j - 1] = ratio.view(heads, n_qt, tile_q).amax(dim=-1)
        m = torch.maximum(m, local)
    return crit


def skipped_fraction(crit: torch.Tensor, lam: float) -> float:
    """Skipped / total tiles at threshold ``lam`` from ``tile_criticals`` (total counts tile 0 too)."""
    heads, n_qt, n_rest = crit.shape
    total = heads * n_qt * (n_rest + 1)
    return float((crit < lam).sum()) / total if total else 0.0


def threshold_for(crit: torch.Tensor, target: float) -> float | None:
    """Smallest threshold that skips at least ``target`` of all tiles, or None when that needs ``lambda > 1``.

    A threshold above 1 would skip tiles that raise the running max: not a sparsity setting.
    """
    heads, n_qt, n_rest = crit.shape
    total = heads * n_qt * (n_rest + 1)
    need = math.ceil(target * total)
    values = crit.flatten()
    if need <= 0 or need > values.numel():
        return None
    kth = torch.kthvalue(values.cpu(), need).values  # need-th smallest critical value
    lam = float(torch.nextafter(kth, torch.tensor(math.inf)))
    return lam if lam <= 1.0 else None
