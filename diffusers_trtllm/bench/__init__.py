"""Attention benchmark: ``python -m diffusers_trtllm.bench --help``.

Runs every implementation in one process on the same inputs: our routes (each
one on every configuration it can serve), torch SDPA with cuDNN and with
FlashAttention-2, FlashInfer FA3 in bf16 and fp8, and SageAttention when it is
installed; reports speed against cuDNN and accuracy against fp32 dense
attention (benchmarks/README.md).
"""

from .inputs import SHAPES, Shape, capture_qkv, load_qkv, save_qkv, structured_qkv
from .suite import Settings, run_suite

__all__ = ["SHAPES", "Shape", "Settings", "run_suite", "structured_qkv", "save_qkv", "load_qkv", "capture_qkv"]
