"""Diffusers' processor setters, wrapped so that ``set_attn_processor(proc)`` binds our layers.

Diffusers' ``set_processor`` keeps no record of the processor it replaces, and an old
``attention_processor.Attention`` does not name its stock processor, so while a processor
of ours exists, ``set_processor`` (of ``Attention`` and ``AttentionModuleMixin``) is
wrapped to hand the replaced processor to ours, and ``AttentionMixin.set_attn_processor``
to name each layer. Both wrappers act only when ours is involved.

The wrapping lasts exactly as long as some processor of ours lives (:func:`hold_setters`, from its
construction, since ``set_attn_processor(proc)`` is an install no hook of ours sees, to its garbage
collection), so it also serves a processor put back after ``uninstall``. :func:`restore_if_unused` puts
the globals ``intercept`` rebound back once no layer of ours is alive, and the setters too once no
processor of ours is. See docs/design.md ("Process-wide state").
"""

from __future__ import annotations

import functools
import gc
import threading
import weakref
from typing import Any

import torch

from .._logging import info_once, logger
from . import intercept
from .layer import detach_layer, layer_of
from .timestep import tracker_of

__all__ = ["hold_setters", "unpatch_diffusers", "restore_if_unused", "drop_layer", "put_processor"]

#: (class, attribute name, Diffusers' original) for every setter we wrapped.
_WRAPPED: list[tuple[type, str, Any]] = []
#: How many processors of ours are alive (each holds the wrapping; a layer holds its processor).
_holders = 0
_holders_lock = threading.RLock()  # (a collection inside the lock may run a finalizer)


def hold_setters(processor: Any, ours: type) -> None:
    """Keep Diffusers' setters wrapped for as long as ``processor`` (an ``ours``) lives."""
    global _holders
    with _holders_lock:
        _patch_diffusers(ours)
        _holders += 1
    weakref.finalize(processor, _release_setters).atexit = False


def _release_setters() -> None:
    """A processor of ours was collected: the last one takes the wrapping with it (its layers went first,
    since each holds its processor)."""
    global _holders
    with _holders_lock:
        _holders -= 1
    restore_if_unused(collect=False)


def put_processor(module: torch.nn.Module, processor: Any) -> None:
    """Put ``processor`` in place without Diffusers' setter (a module without one, or bypassing our wrapper)."""
    module._modules.pop("processor", None)
    module.processor = processor


def drop_layer(module: torch.nn.Module, restore: bool, ours: type) -> None:
    """Take our layer off ``module``; ``restore``: put its stock processor back where ``ours`` serves it."""
    state = detach_layer(module)
    if state is None:
        return
    state.processor.release(module, state)
    if restore and isinstance(getattr(module, "processor", None), ours):
        if state.stock is None:
            raise RuntimeError(f"{type(module).__name__} has no recorded stock processor to restore ({state.reason}).")
        put_processor(module, state.stock)


def restore_if_unused(collect: bool = True) -> bool:
    """Restore Diffusers' globals once no layer of ours is alive (True if so), and its setters once no
    processor of ours is either.

    ``collect``: first free layers of models dropped in a reference cycle (a garbage collection:
    once per ``uninstall``, not per module).
    """
    if intercept.live_layers() and collect:
        gc.collect()
    if intercept.live_layers():
        return False
    restored = intercept.restore_globals()
    with _holders_lock:
        if not _holders:
            unpatch_diffusers()
    if restored:
        logger.debug("diffusers_trtllm: restored Diffusers' globals in %s", ", ".join(restored))
    return True


def _patch_diffusers(ours: type) -> None:
    """Wrap Diffusers' processor setters (once) so installing an ``ours`` records the processor it replaces."""
    if _WRAPPED:
        return
    from diffusers.models.attention import AttentionMixin, AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    for cls in (AttentionModuleMixin, Attention):
        original = cls.__dict__["set_processor"]

        @functools.wraps(original)
        def set_processor(self, processor, _original=original):
            replaced = getattr(self, "processor", None)
            if isinstance(replaced, ours) and layer_of(self) is not None and _is_fused(self, processor):
                # fuse_qkv_projections() after install: the fused processor does this layer's projections
                # from now on, and ours keeps serving its attention.
                unfused = layer_of(self).stock
                replaced.bind(self, replaced=processor)
                layer_of(self).unfused_stock = unfused
                info_once(("fused", type(processor).__name__),
                          "TrtllmAttnProcessor: %s now does the fused projections; the attention calls stay served.",
                          type(processor).__name__)
                return
            _original(self, processor)
            if isinstance(processor, ours):
                processor.bind(self, replaced=replaced)
            elif layer_of(self) is not None:
                drop_layer(self, restore=False, ours=ours)
                restore_if_unused(collect=False)

        _WRAPPED.append((cls, "set_processor", original))
        cls.set_processor = set_processor

    original_set = AttentionMixin.__dict__["set_attn_processor"]

    @functools.wraps(original_set)
    def set_attn_processor(self, processor):
        # unfuse_qkv_projections() of an old-style model (SD3) puts back the processors it saved at fusing,
        # which are ours: the stock processors the fuse replaced go back under them, as without us.
        unfusing = isinstance(processor, dict) and processor is getattr(self, "original_attn_processors", None)
        original_set(self, processor)
        served = False
        for name, module in self.named_modules():
            state = layer_of(module)
            if state is not None and isinstance(getattr(module, "processor", None), ours):
                if unfusing and state.unfused_stock is not None:
                    state.processor.bind(module, replaced=state.unfused_stock)
                    state.unfused_stock = None
                state.rename(name, module)
                served = True
        if served:
            tracker_of(self).reset()  # this processor's statistics start at step 0

    _WRAPPED.append((AttentionMixin, "set_attn_processor", original_set))
    AttentionMixin.set_attn_processor = set_attn_processor


def _is_fused(module: torch.nn.Module, processor: Any) -> bool:
    """Whether ``processor`` is Diffusers' fused-projection variant handed to a module whose projections
    ``fuse_qkv_projections()`` just fused (SD3, CogVideoX, HunyuanDiT, AuraFlow, PixArt)."""
    return bool(getattr(module, "fused_projections", False)) and type(processor).__name__.startswith("Fused")


def unpatch_diffusers() -> None:
    """Put Diffusers' own processor setters back."""
    while _WRAPPED:
        cls, name, original = _WRAPPED.pop()
        setattr(cls, name, original)
