"""Shared test helpers: the GPU marker and the accuracy metrics (the benchmark's own)."""

from __future__ import annotations

import pytest
import torch

from diffusers_trtllm.bench.timing import cosine, rel_l1

__all__ = ["requires_cuda", "rel_l1", "cosine"]

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
