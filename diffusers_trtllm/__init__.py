"""TRT-LLM attention kernels (skip-softmax sparsity, SAGE quantization) for Hugging Face Diffusers."""

from .attention import attention, run_attention
from .calibration import load_calibration, save_calibration
from .calibrator import SparsityCalibration, calibrate
from .config import ControlTypeError, QuantConfig, SkipSoftmaxConfig
from .integration import install, uninstall
from .layout import MaskNotSupportedError, PackedLayout
from .processor import TrtllmAttnProcessor
from .routing import NoRouteError, route_names
from .timestep import DenoiseStepCallback, attach_denoise_tracking, detach_denoise_tracking

__version__ = "0.1.0"

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
