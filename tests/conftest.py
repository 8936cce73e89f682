"""Shared test helpers: the GPU marker and accuracy metrics."""

from __future__ import annotations

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_l1(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L1 error ``sum|out - ref| / sum|ref|`` in float64."""
    out, ref = out.double(), ref.double()
    return float((out - ref).abs().sum() / ref.abs().sum())


def cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0))
