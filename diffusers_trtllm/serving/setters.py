"""Diffusers' processor setters, wrapped so that ``set_attn_processor(proc)`` binds our layers.

Diffusers' ``set_processor`` keeps no record of the processor it replaces, and an old
``attention_processor.Attention`` does not name its stock processor, so while something of
ours needs it, ``set_processor`` (of ``Attention`` and ``AttentionModuleMixin``) is wrapped to
hand the replaced processor to ours, and ``AttentionMixin.set_attn_processor`` to name each
layer. Both wrappers act only when ours is involved, and pass every other call to Diffusers'
own function unchanged.

The wrapping lasts while a layer of ours lives, or a processor of ours that has served no
layer yet (:func:`hold_setters`, from its construction, since ``set_attn_processor(proc)`` is
an install no hook of ours sees). After the last ``uninstall`` Diffusers is its own again
(:func:`restore_if_unused`), and putting a processor back with Diffusers' setter binds lazily,
from the stock processor ``uninstall`` (or a setter replacing ours) put back (:func:`restored_stock`). Our class is named
in Diffusers' layer-skip registry for the same time (:mod:`.guidance`). See docs/design.md
("Process-wide state").
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
from .guidance import register_skip_output, unregister_skip_output
from .calibrated import apply_calibration, section_for
from .ip_adapter import stop_serving_in_place
from .layer import detach_layer, layer_of
from .timestep import follow_timesteps, stop_following_timesteps, tracker_of

__all__ = ["hold_setters", "layer_bound", "unpatch_diffusers", "restore_if_unused", "drop_layer", "put_processor",
           "recorded_replacement", "restored_stock"]

#: (class, attribute name, Diffusers' original) for every setter we wrapped.
_WRAPPED: list[tuple[type, str, Any]] = []
#: Our class, while it is named in Diffusers' layer-skip registry.
_REGISTERED: list[type] = []
#: ids of the processors of ours that have served no layer yet: each holds the wrapping (``set_attn_processor(proc)``).
_pending: set[int] = set()
#: Module -> the stock processor ``uninstall`` put back on it, for a processor put back by Diffusers' own setter.
_restored: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()
_lock = threading.RLock()  # (a collection inside the lock may run a finalizer)
#: Per thread: ``set_attn_processor`` was given one processor for every layer (see ``_one_for_all``).
_setting_all = threading.local()


def hold_setters(processor: Any, ours: type) -> None:
    """Keep Diffusers' setters wrapped until ``processor`` (an ``ours``) serves a layer or is collected."""
    with _lock:
        _patch_diffusers(ours)
        _pending.add(id(processor))
    weakref.finalize(processor, _collected, id(processor)).atexit = False


def _collected(processor_id: int) -> None:
    """A processor of ours was collected (its layers went first, since each holds its processor)."""
    with _lock:
        _pending.discard(processor_id)
    restore_if_unused(collect=False)


def layer_bound(processor: Any, ours: type) -> None:
    """``processor`` serves a layer: the layer holds the wrapping from now on (wrapped again if an ``uninstall``
    had put Diffusers' setters back and the processor was then put back by them)."""
    with _lock:
        _patch_diffusers(ours)
        _pending.discard(id(processor))


def recorded_replacement(module: torch.nn.Module, current: Any) -> Any:
    """The processor that ``current`` (on ``module`` now) stands for as the layer's stock one: None when a layer of
    ours already records its stock processor, since ``current`` was then put in by attribute over ours, which
    only a transient swap does (PAG pipelines put their processors in that way, and ours back with
    ``set_attn_processor``); the setters' path would have dropped our layer."""
    state = layer_of(module)
    return None if state is not None and state.stock is not None else current


def restored_stock(module: torch.nn.Module) -> Any:
    """The stock processor ``uninstall``, or a setter replacing ours, put back on ``module`` (None if none was)."""
    return _restored.get(module)


def put_processor(module: torch.nn.Module, processor: Any) -> None:
    """Put ``processor`` in place without Diffusers' setter (a module without one, or bypassing our wrapper)."""
    module._modules.pop("processor", None)
    module.processor = processor


def drop_layer(module: torch.nn.Module, restore: bool, ours: type) -> None:
    """Take our layer off ``module``; ``restore``: put its stock processor back where ``ours`` serves it."""
    state = detach_layer(module)
    if state is None:
        return
    stop_serving_in_place(module)
    state.processor._release(module, state)
    if restore and isinstance(getattr(module, "processor", None), ours):
        if state.stock is None:
            raise RuntimeError(f"{type(module).__name__} has no recorded stock processor to restore ({state.reason}).")
        put_processor(module, state.stock)
        _restored[module] = state.stock


def restore_if_unused(collect: bool = True) -> bool:
    """Restore Diffusers' globals once no layer of ours is alive (True if so), and its setters once no
    processor of ours waits for its first layer either.

    ``collect``: first free layers of models dropped in a reference cycle (a garbage collection:
    once per ``uninstall``, not per module).
    """
    if intercept.live_layers() and collect:
        gc.collect()
    if intercept.live_layers():
        return False
    restored = intercept.restore_globals()
    with _lock:
        if not _pending:
            unpatch_diffusers()
    if restored:
        logger.debug("diffusers_trtllm: restored Diffusers' globals in %s", ", ".join(restored))
    return True


def _patch_diffusers(ours: type) -> None:
    """Wrap Diffusers' processor setters (once) so installing an ``ours`` records the processor it replaces."""
    if _WRAPPED:
        return
    register_skip_output(ours)
    _REGISTERED.append(ours)
    from diffusers.models.attention import AttentionMixin, AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    for cls in (AttentionModuleMixin, Attention):
        original = cls.__dict__["set_processor"]

        @functools.wraps(original)
        def set_processor(self, processor, _original=original):
            if isinstance(processor, ours):
                processor._check_machine()  # before the layer changes hands
            replaced = getattr(self, "processor", None)
            state = layer_of(self)
            if state is not None and intercept.is_ip_adapter(processor) and (state.in_place or isinstance(replaced, ours)):
                # load_ip_adapter over a layer we serve: the adapter's processor takes the layer, ours serves it there.
                _original(self, processor)
                state.processor._bind(self, replaced=processor, in_place=True)
                return
            if state is not None and state.in_place and not isinstance(processor, ours) and not _one_for_all():
                # unload_ip_adapter: the processor replacing the adapter's goes under ours, as the adapter's came.
                _original(self, state.processor)
                state.processor._bind(self, replaced=processor)
                return
            if isinstance(replaced, ours) and layer_of(self) is not None and _is_fused(self, processor):
                # fuse_qkv_projections() after install: the fused processor does this layer's projections
                # from now on, and ours keeps serving its attention.
                unfused = layer_of(self).stock
                replaced._bind(self, replaced=processor)
                layer_of(self).unfused_stock = unfused
                info_once(("fused", type(processor).__name__),
                          "TrtllmAttnProcessor: %s now does the fused projections; the attention calls stay served.",
                          type(processor).__name__)
                return
            _original(self, processor)
            if isinstance(processor, ours):
                processor._bind(self, replaced=recorded_replacement(self, replaced))
            elif layer_of(self) is not None:
                drop_layer(self, restore=False, ours=ours)
                _restored[self] = processor  # the stock again, should ours be put back once these setters are Diffusers'
                restore_if_unused(collect=False)

        _WRAPPED.append((cls, "set_processor", original))
        cls.set_processor = set_processor

    original_set = AttentionMixin.__dict__["set_attn_processor"]

    @functools.wraps(original_set)
    def set_attn_processor(self, processor):
        # unfuse_qkv_projections() of an old-style model (SD3) puts back the processors it saved at fusing,
        # which are ours: the stock processors the fuse replaced go back under them, as without us.
        unfusing = isinstance(processor, dict) and processor is getattr(self, "original_attn_processors", None)
        # A processor carrying a calibration (from_pretrained): its section for this model, refused before any change.
        record = processor._calibration if isinstance(processor, ours) else None
        carried = section_for(record, self) if record is not None else None
        if isinstance(processor, dict):
            processor = _keep_rebuilt(self, processor, ours)
            original_set(self, processor)
        else:
            _setting_all.active = True
            try:
                original_set(self, processor)
            finally:
                _setting_all.active = False
        served = False
        for name, module in self.named_modules():
            state = layer_of(module)
            if state is not None and isinstance(getattr(module, "processor", None), ours):
                if unfusing and state.unfused_stock is not None:
                    state.processor._bind(module, replaced=state.unfused_stock)
                    state.unfused_stock = None
                state.rename(name, module)
                served = True
        if served:
            tracker_of(self).reset()  # this processor's statistics start at step 0
            follow_timesteps([self])  # gated by the timestep this model's forward is called with
            if carried is not None:
                apply_calibration(self, carried, record.source)
        else:
            stop_following_timesteps(self)

    _WRAPPED.append((AttentionMixin, "set_attn_processor", original_set))
    AttentionMixin.set_attn_processor = set_attn_processor


def _one_for_all() -> bool:
    """Whether this thread's ``set_processor`` call is part of ``set_attn_processor(one processor)``: that is
    honoured on every layer, an IP-Adapter's included."""
    return getattr(_setting_all, "active", False)


def _keep_rebuilt(model: torch.nn.Module, processors: dict, ours: type) -> dict:
    """``processors`` with every blank ``ours`` (built with no arguments, never installed) that would replace
    one of ours kept as the one serving the layer: that is Diffusers rebuilding processors by class,
    ``type(proc)()``, as ``load_ip_adapter`` and ``unload_ip_adapter`` do, which would drop the user's settings.
    One processor given for every layer (not a dict) is always honoured."""
    kept = dict(processors)
    for name, module in model.named_modules():
        key = f"{name}.processor"
        new, current = kept.get(key), getattr(module, "processor", None)
        if isinstance(new, ours) and new._is_blank and isinstance(current, ours) and new is not current:
            kept[key] = current
            info_once(("rebuilt-by-class",),
                      "TrtllmAttnProcessor: set_attn_processor was handed a new TrtllmAttnProcessor() per layer "
                      "(Diffusers rebuilding processors by class, as load_ip_adapter / unload_ip_adapter do); each "
                      "layer keeps the processor serving it, with its settings.")
    return kept


def _is_fused(module: torch.nn.Module, processor: Any) -> bool:
    """Whether ``processor`` is Diffusers' fused-projection variant handed to a module whose projections
    ``fuse_qkv_projections()`` just fused (SD3, CogVideoX, HunyuanDiT, AuraFlow, PixArt)."""
    return bool(getattr(module, "fused_projections", False)) and type(processor).__name__.startswith("Fused")


def unpatch_diffusers() -> None:
    """Put Diffusers' own processor setters back, and take our class out of its layer-skip registry."""
    while _WRAPPED:
        cls, name, original = _WRAPPED.pop()
        setattr(cls, name, original)
    while _REGISTERED:
        unregister_skip_output(_REGISTERED.pop())
