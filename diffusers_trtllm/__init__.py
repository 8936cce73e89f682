"""TRT-LLM attention kernels (skip-softmax sparsity, SAGE quantization) for Hugging Face Diffusers."""

from .attention import attention, run_attention
from .calibration import SparsityCalibration, calibrate, load_calibration, save_calibration
from .config import ControlTypeError, QuantConfig, SkipSoftmaxConfig
from .layout import MaskNotSupportedError, PackedLayout
from .routing import NoRouteError, route_names
from .serving import install, uninstall
from .serving.processor import TrtllmAttnProcessor
from .serving.timestep import DenoiseStepCallback, attach_denoise_tracking, detach_denoise_tracking
from .version import __version__

__all__ = [
    "attention",
    "run_attention",
    "QuantConfig",
    "SkipSoftmaxConfig",
    "PackedLayout",
    "ControlTypeError",
    "MaskNotSupportedError",
    "NoRouteError",
    "route_names",
    "TrtllmAttnProcessor",
    "install",
    "uninstall",
    "DenoiseStepCallback",
    "attach_denoise_tracking",
    "detach_denoise_tracking",
    "load_calibration",
    "save_calibration",
    "calibrate",
    "SparsityCalibration",
]
