"""TRT-LLM attention kernels (skip-softmax sparsity, SAGE quantization) for Hugging Face Diffusers."""

from .attention import attention, run_attention
from .config import QuantConfig, SkipSoftmaxConfig
from .layout import PackedLayout
from .routes import NoRouteError, route_names

__version__ = "0.1.0"

__all__ = [
    "attention",
    "run_attention",
    "QuantConfig",
    "SkipSoftmaxConfig",
    "PackedLayout",
    "NoRouteError",
    "route_names",
]
