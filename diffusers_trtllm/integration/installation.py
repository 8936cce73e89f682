"""Installing the processor on any pipeline or module, and taking it out again.

:func:`install` serves every attention module (any module with a ``processor``)
of a pipeline's transformers (``transformer``, ``transformer_2``, ``unet``, ...) or of
any ``torch.nn.Module``, whether or not its class has ``set_attn_processor`` /
``set_processor`` (29 Diffusers transformers have no ``set_attn_processor``;
``MochiAttention`` has no ``set_processor``). :func:`uninstall` puts the stock
processors back, and once no layer of ours is left anywhere, every Diffusers
global we changed: the rebound module globals (``intercept.restore_globals``) and
the wrapped processor setters below.

``pipe.transformer.set_attn_processor(proc)`` keeps working: Diffusers'
``set_processor`` keeps no record of the processor it replaces, and an old
``attention_processor.Attention`` does not name its stock processor, so while a
processor of ours exists, ``set_processor`` (of ``Attention`` and
``AttentionModuleMixin``) is wrapped to hand the replaced processor to ours, and
``AttentionMixin.set_attn_processor`` to name each layer. Both wrappers act only
when ours is involved. See docs/design.md.
"""

from __future__ import annotations

import functools
import gc
from typing import Any

import torch

from .._logging import logger
from . import intercept

__all__ = ["install", "uninstall", "target_modules", "patch_diffusers", "unpatch_diffusers"]

#: Pipeline components served by ``install(pipe, proc)``: names starting with these.
_COMPONENT_PREFIXES = ("transformer", "unet", "prior", "decoder")
#: (class, attribute name, Diffusers' original) for every setter we wrapped.
_WRAPPED: list[tuple[type, str, Any]] = []


def _is_ours(processor: Any) -> bool:
    from ..processor import TrtllmAttnProcessor

    return isinstance(processor, TrtllmAttnProcessor)


def _has_processor(module: torch.nn.Module) -> bool:
    return callable(getattr(module, "processor", None)) and not isinstance(module, torch.nn.ModuleList)


def target_modules(target: Any) -> dict[str, torch.nn.Module]:
    """The modules ``install(target, ...)`` serves: ``target`` itself, or a pipeline's transformers."""
    if isinstance(target, torch.nn.Module):
        return {"": target}
    components = getattr(target, "components", None)
    if not isinstance(components, dict):
        components = {k: v for k, v in vars(target).items() if not k.startswith("_")}
    found = {name: m for name, m in components.items()
             if isinstance(m, torch.nn.Module) and name.startswith(_COMPONENT_PREFIXES)}
    if not found:
        raise ValueError(
            f"{type(target).__name__} holds no transformer or UNet (components named "
            f"{', '.join(p + '*' for p in _COMPONENT_PREFIXES)}); pass a pipeline or a torch.nn.Module."
        )
    return found


def _set_processor(module: torch.nn.Module, processor: Any) -> None:
    """Put ``processor`` in place without Diffusers' setter (a module without one, or bypassing our wrapper)."""
    module._modules.pop("processor", None)
    module.processor = processor


def install(target: Any, processor: Any) -> Any:
    """Serve every attention module of ``target`` (a pipeline or any module) with ``processor``.

    A pipeline's transformers share one timestep tracker (Wan 2.2's two experts count
    their steps together). Returns ``target``.
    """
    from ..timestep import tracker_of

    if not _is_ours(processor):
        raise TypeError(f"install() takes a TrtllmAttnProcessor; got {type(processor).__name__}.")
    patch_diffusers()
    tracker = None
    served = 0
    for module_root in target_modules(target).values():
        for name, module in module_root.named_modules():
            if not _has_processor(module):
                continue
            # A processor of ours being replaced: the layer keeps the stock processor it recorded.
            processor.bind(module, replaced=module.processor, name=name or None)
            _set_processor(module, processor)
            served += 1
        tracker = tracker_of(module_root, tracker)
    if not served:
        raise ValueError(f"{type(target).__name__} has no attention module (no module with a `processor`) to serve.")
    logger.debug("TrtllmAttnProcessor installed on %d attention modules of %s", served, type(target).__name__)
    return target


def uninstall(target: Any) -> Any:
    """Put back the stock processors of ``target``'s attention modules and drop our state from them.

    Once no layer of ours is left in the process, Diffusers' module globals and
    processor setters are restored too, so the model runs exactly as a fresh one.
    Returns ``target``.
    """
    from ..timestep import HOOK_NAME, TRACKER_ATTR

    for module_root in target_modules(target).values():
        for module in module_root.modules():
            _drop_layer(module, restore=True)
        module_root.__dict__.pop(TRACKER_ATTR, None)
        registry = getattr(module_root, "_diffusers_hook", None)
        if registry is not None and registry.get_hook(HOOK_NAME) is not None:
            registry.remove_hook(HOOK_NAME, recurse=False)
    restore_if_unused()
    return target


def _drop_layer(module: torch.nn.Module, restore: bool) -> None:
    state = module.__dict__.pop("_trtllm_layer", None)
    if state is None:
        return
    state.processor._layers.discard(state)
    intercept.unregister_layer(state.key)
    if restore and _is_ours(getattr(module, "processor", None)):
        if state.stock is None:
            raise RuntimeError(f"{type(module).__name__} has no recorded stock processor to restore ({state.reason}).")
        _set_processor(module, state.stock)


def restore_if_unused(collect: bool = True) -> bool:
    """Restore Diffusers' globals and setters once no layer of ours is alive; True if it did.

    ``collect``: first free layers of models dropped in a reference cycle (a garbage collection:
    once per ``uninstall``, not per module).
    """
    if intercept.live_layers() and collect:
        gc.collect()
    if intercept.live_layers():
        return False
    restored = intercept.restore_globals()
    unpatch_diffusers()
    if restored:
        logger.debug("diffusers_trtllm: restored Diffusers' globals in %s", ", ".join(restored))
    return True


# ---- Diffusers' processor setters ---------------------------------------------------------------
def patch_diffusers() -> None:
    """Wrap Diffusers' processor setters (once) so installing ours records the processor it replaces."""
    if _WRAPPED:
        return
    from diffusers.models.attention import AttentionMixin, AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    for cls in (AttentionModuleMixin, Attention):
        original = cls.__dict__["set_processor"]

        @functools.wraps(original)
        def set_processor(self, processor, _original=original):
            replaced = getattr(self, "processor", None)
            _original(self, processor)
            if _is_ours(processor):
                processor.bind(self, replaced=replaced)
            elif "_trtllm_layer" in self.__dict__:
                _drop_layer(self, restore=False)
                restore_if_unused(collect=False)

        _WRAPPED.append((cls, "set_processor", original))
        cls.set_processor = set_processor

    original_set = AttentionMixin.__dict__["set_attn_processor"]

    @functools.wraps(original_set)
    def set_attn_processor(self, processor):
        from ..timestep import tracker_of

        original_set(self, processor)
        served = False
        for name, module in self.named_modules():
            state = module.__dict__.get("_trtllm_layer")
            if state is not None and _is_ours(getattr(module, "processor", None)):
                state.rename(name, module)
                served = True
        if served:
            tracker_of(self)

    _WRAPPED.append((AttentionMixin, "set_attn_processor", original_set))
    AttentionMixin.set_attn_processor = set_attn_processor


def unpatch_diffusers() -> None:
    """Put Diffusers' own processor setters back."""
    while _WRAPPED:
        cls, name, original = _WRAPPED.pop()
        setattr(cls, name, original)
