"""Shared test helpers: the GPU marker, the accuracy metrics (the benchmark's own), and a fixture that forgets
the once-per-process warnings."""

from __future__ import annotations

import pytest
import torch
from diffusers.utils import logging as diffusers_logging

from diffusers_trtllm import _logging
from diffusers_trtllm.measure import cosine, rel_l1

__all__ = ["requires_cuda", "rel_l1", "cosine"]

# Diffusers' library logger (ours is its child) does not propagate to the root, where pytest's caplog listens.
diffusers_logging.enable_propagation()

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def fresh_warnings():
    """Warnings are issued once per process: forget the ones earlier tests raised."""
    saved = set(_logging._warned)
    _logging._warned.clear()
    yield
    _logging._warned.clear()
    _logging._warned.update(saved)
