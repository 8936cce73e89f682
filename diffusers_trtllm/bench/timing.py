"""Timing and metrics: median CUDA-event time, TFLOP/s, accuracy against fp32 dense, skip statistics."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["Timing", "time_fn", "rel_l1", "cosine", "tile_criticals", "skipped_fraction", "threshold_for"]


@dataclass
class Timing:
    median_ms: float
    iters: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup: int = 2,
    iters: int = 10,
    max_seconds: float = 3.0,
) -> Timing:
    """Median time of ``fn`` after ``warmup`` calls; fewer iterations (>= 1) when one call is slow.

    On CUDA each call is bracketed by its own pair of events; elsewhere by ``perf_counter``.
    """
    for _ in range(max(warmup, 1)):
        fn()

    def once() -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    _sync(device)
    times = [once()]
    n = max(1, min(iters, int(max_seconds * 1e3 / max(times[0], 1e-3))))
    times += [once() for _ in range(n - 1)]
    return Timing(statistics.median(times), len(times))


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
