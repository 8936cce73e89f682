"""Timing: median CUDA-event time of a callable (the metrics it reports are ``diffusers_trtllm.measure``'s)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["Timing", "time_fn"]


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
