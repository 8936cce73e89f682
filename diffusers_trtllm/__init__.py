"""TRT-LLM attention kernels (skip-softmax sparsity, SAGE quantization) for Hugging Face Diffusers.

The public names load on first use (PEP 562), so ``python -m diffusers_trtllm --help`` and the
command line's argument checks answer before torch and Diffusers are imported.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from .version import __version__

#: Public name -> the module that defines it.
_EXPORTS = {
    "attention": "attention",
    "run_attention": "attention",
    "QuantConfig": "config",
    "SkipSoftmaxConfig": "config",
    "ControlTypeError": "config",
    "PackedLayout": "layout",
    "MaskNotSupportedError": "layout",
    "NoRouteError": "routing",
    "route_names": "routing",
    "TrtllmAttnProcessor": "serving.processor",
    "install": "serving",
    "uninstall": "serving",
    "DenoiseStepCallback": "serving.timestep",
    "attach_denoise_tracking": "serving.timestep",
    "detach_denoise_tracking": "serving.timestep",
    "load_calibration": "calibration",
    "save_calibration": "calibration",
    "calibrate": "calibration",
    "SparsityCalibration": "calibration",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
    """The package module: importing a submodule that shares a public name (``attention``) keeps the name's
    function, as an eager ``from .attention import attention`` did."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
