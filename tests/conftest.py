"""Shared test helpers: the GPU marker, the accuracy metrics (the benchmark's own), a fixture that forgets the
once-per-process warnings, and the background jobs' start."""

from __future__ import annotations

import pytest
import torch
from diffusers.utils import logging as diffusers_logging

from background_jobs import BackgroundJob
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


def pytest_collection_finish(session):
    """Start the background jobs (``background_jobs``) of the tests selected, so they run beside the others."""
    if session.config.option.collectonly:
        return
    items = [(item.module, item.originalname) for item in session.items if isinstance(item, pytest.Function)]
    selected, modules = set(items), dict.fromkeys(module for module, _ in items)  # modules in the order they run
    BackgroundJob.start_in_turn([job for module in modules for job in vars(module).values()
                                 if isinstance(job, BackgroundJob) and any((module, t) in selected for t in job.tests)])


def pytest_sessionfinish(session):
    BackgroundJob.stop_all()
