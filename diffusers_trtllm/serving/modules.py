"""Which modules of a pipeline are its denoisers: the one rule every entry point uses.

``install``, ``uninstall``, ``calibrate``, ``load_calibration``, ``save_calibration`` and
``attach_denoise_tracking`` all serve the same components: a pipeline's ``torch.nn.Module``
components whose names start with ``transformer``, ``unet``, ``prior`` or ``decoder``
(``transformer`` and ``transformer_2`` for Wan 2.2's two experts, ``unet`` for SD 1.x/XL,
``prior`` / ``decoder`` for Kandinsky-style and Würstchen pipelines).
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import DENOISER_PREFIXES, ControlTypeError, is_denoiser_name

__all__ = ["DENOISER_PREFIXES", "is_denoiser_name", "denoisers", "target_modules", "uncompiled", "attention_modules"]


def denoisers(pipe: Any, purpose: str = "serve") -> dict[str, torch.nn.Module]:
    """A pipeline's denoisers by component name; raises ``ControlTypeError`` (also a ValueError) if none.

    ``purpose`` (``"serve"``, ``"track"``, ...) only words the error.
    """
    components = getattr(pipe, "components", None)
    if not isinstance(components, dict):
        components = {k: v for k, v in getattr(pipe, "__dict__", {}).items() if not k.startswith("_")}
    found = {name: m for name, m in components.items() if isinstance(m, torch.nn.Module) and is_denoiser_name(name)}
    if not found:
        raise ControlTypeError(
            f"{type(pipe).__name__} has no transformer to {purpose} (components named "
            f"{', '.join(p + '*' for p in DENOISER_PREFIXES)}); pass a pipeline or a torch.nn.Module."
        )
    return found


def target_modules(target: Any, purpose: str = "serve") -> dict[str, torch.nn.Module]:
    """``target`` itself (a module, named ``""``), or a pipeline's denoisers."""
    if isinstance(target, torch.nn.Module):
        return {"": target}
    return denoisers(target, purpose)


def uncompiled(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside a ``torch.compile(model)`` wrapper, else ``module``: layers are named as in the model
    (``blocks.0.attn1``, not ``_orig_mod.blocks.0.attn1``), so calibrations' ``ignore`` and ``targets`` match."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else module


def attention_modules(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The attention modules of ``root`` (any module with a callable ``processor``), by name: what ``install`` serves."""
    return [(name, m) for name, m in uncompiled(root).named_modules()
            if callable(getattr(m, "processor", None)) and not isinstance(m, torch.nn.ModuleList)]
