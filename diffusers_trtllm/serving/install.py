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
from .calibrated import apply_calibration, check_layers, denoiser_name, model_layers
from .intercept import is_ip_adapter
from .modules import attention_modules, target_modules
from .processor import TrtllmAttnProcessor
from .setters import drop_layer, put_processor, recorded_replacement, restore_if_unused
from .timestep import detach_tracker, follow_timesteps, tracker_of

__all__ = ["install", "uninstall"]


def install(target: Any, processor: TrtllmAttnProcessor) -> Any:
    """Serve every attention module of ``target`` (a pipeline or any module) with ``processor``.

    A pipeline's denoisers share one timestep tracker (Wan 2.2's two experts count
    their steps together). A processor carrying a calibration (``from_pretrained``, or an earlier
    ``load_calibration``) gives it to the layers; one made for other layers is refused before anything changes.
    Returns ``target``.
    """
    if not isinstance(processor, TrtllmAttnProcessor):
        raise TypeError(f"install() takes a TrtllmAttnProcessor; got {type(processor).__name__}.")
    processor._check_machine()
    roots = target_modules(target)
    record = processor._calibration
    if record is not None:  # a saved setting's calibration: refused before anything changes if made for other layers
        check_layers(record.sections, {denoiser_name(attr): model_layers(root) for attr, root in roots.items()},
                     record.source)
    tracker = None
    served = 0
    for module_root in roots.values():
        for name, module in attention_modules(module_root):
            served += 1
            if is_ip_adapter(module.processor):  # it keeps the layer, ours serves it there (serving.ip_adapter)
                processor._bind(module, replaced=module.processor, name=name or None, in_place=True)
                continue
            # A processor of ours being replaced (or one swapped in over ours by attribute): the layer keeps the
            # stock processor it recorded.
            processor._bind(module, replaced=recorded_replacement(module, module.processor), name=name or None)
            put_processor(module, processor)
        tracker = tracker_of(module_root, tracker)
    tracker.reset()  # this processor's statistics start at step 0
    if not served:
        raise ValueError(f"{type(target).__name__} has no attention module (no module with a `processor`) to serve.")
    if record is not None:
        apply_calibration(target, record.sections, record.source)
    # Gated by the timestep each forward is called with (a pipeline's scheduler helps number the steps).
    follow_timesteps(list(roots.values()), None if isinstance(target, torch.nn.Module) else target)
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
