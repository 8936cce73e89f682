"""Installing the processor on any pipeline or module, and taking it out again.

:func:`install` serves every attention module (any module with a ``processor``)
of a pipeline's denoisers (``serving.modules``: ``transformer``, ``transformer_2``,
``unet``, ...) or of any ``torch.nn.Module``, whether or not its class has
``set_attn_processor`` / ``set_processor`` (29 Diffusers transformers have no
``set_attn_processor``; ``MochiAttention`` has no ``set_processor``). :func:`uninstall`
puts the stock processors back, and once no layer of ours is left anywhere, every
Diffusers global and setter we changed (``setters.restore_if_unused``);
``pipe.transformer.set_attn_processor(proc)`` works too, before an install or after an
uninstall (``serving.setters``).
See docs/design.md.
"""

from __future__ import annotations

from typing import Any

import torch

from .._logging import logger
from .intercept import is_ip_adapter
from .modules import target_modules, uncompiled
from .processor import TrtllmAttnProcessor
from .setters import drop_layer, put_processor, recorded_replacement, restore_if_unused
from .timestep import detach_tracker, tracker_of

__all__ = ["install", "uninstall"]


def _has_processor(module: torch.nn.Module) -> bool:
    return callable(getattr(module, "processor", None)) and not isinstance(module, torch.nn.ModuleList)


def install(target: Any, processor: TrtllmAttnProcessor) -> Any:
    """Serve every attention module of ``target`` (a pipeline or any module) with ``processor``.

    A pipeline's denoisers share one timestep tracker (Wan 2.2's two experts count
    their steps together). Returns ``target``.
    """
    if not isinstance(processor, TrtllmAttnProcessor):
        raise TypeError(f"install() takes a TrtllmAttnProcessor; got {type(processor).__name__}.")
    tracker = None
    served = 0
    for module_root in target_modules(target).values():
        for name, module in uncompiled(module_root).named_modules():
            if not _has_processor(module):
                continue
            served += 1
            if is_ip_adapter(module.processor):  # it keeps the layer, ours serves it there (serving.ip_adapter)
                processor.bind(module, replaced=module.processor, name=name or None, in_place=True)
                continue
            # A processor of ours being replaced (or one swapped in over ours by attribute): the layer keeps the
            # stock processor it recorded.
            processor.bind(module, replaced=recorded_replacement(module, module.processor), name=name or None)
            put_processor(module, processor)
        tracker = tracker_of(module_root, tracker)
    tracker.reset()  # this processor's statistics start at step 0
    if not served:
        raise ValueError(f"{type(target).__name__} has no attention module (no module with a `processor`) to serve.")
    logger.debug("TrtllmAttnProcessor installed on %d attention modules of %s", served, type(target).__name__)
    return target


def uninstall(target: Any) -> Any:
    """Put back the stock processors of ``target``'s attention modules and drop our state from them.

    Once no layer of ours is left in the process, Diffusers' module globals and
    processor setters are restored too (unless a processor of ours awaits its first layer),
    so the model runs exactly as a fresh one.
    Returns ``target``.
    """
    for module_root in target_modules(target).values():
        for module in module_root.modules():
            drop_layer(module, restore=True, ours=TrtllmAttnProcessor)
        detach_tracker(module_root)
    restore_if_unused()
    return target
