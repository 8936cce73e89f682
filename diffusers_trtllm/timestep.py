"""Telling the processor which denoising step it is in, for ``disabled_until_timestep``.

Two ways, usable together:

- ``attach_denoise_tracking(pipe, proc)``: a Diffusers ``ModelHook`` on each
  transformer (``transformer``, ``transformer_2``) hands the ``timestep`` argument
  of every forward to the processor *before* that forward runs, so every step,
  the first included, is gated right. The hook only stores the tensor; its value
  is read inside our attention op (one sync per forward), so ``torch.compile``
  sees no graph break.
- ``DenoiseStepCallback(proc)``: a ``PipelineCallback`` for ``callback_on_step_end``
  (alone or in ``MultiPipelineCallbacks``). Diffusers calls it after a step, so it
  publishes the *next* step's ``t``; the first step runs dense (right whenever
  ``disabled_until_timestep`` is below the first ``t``, as it is in practice).

Normalization: ``t = timestep / scheduler.config.num_train_timesteps`` in [0, 1].
Flux, Flux2 and Qwen-Image pipelines already hand the transformer ``t / 1000``;
Wan, SD3, HunyuanVideo, LTX and CogVideoX hand it the raw timestep. The hook tells
them apart per call by which reading lies nearer the scheduler's own timestep
list: the raw value itself (then divide) or the value times ``num_train_timesteps``
(already normalized). Without a scheduler it falls back to "above 1 means raw".
"""

from __future__ import annotations

import inspect
import math
import weakref
from typing import Any, Callable

import torch
from diffusers.callbacks import PipelineCallback
from diffusers.hooks import HookRegistry, ModelHook

from .config import ControlTypeError

__all__ = ["DenoiseStepCallback", "attach_denoise_tracking", "detach_denoise_tracking", "TimestepNormalizer"]

HOOK_NAME = "diffusers_trtllm.denoise_tracking"
_TRANSFORMER_ATTRS = ("transformer", "transformer_2")
#: A reading this close (in t) to a scheduler timestep is that timestep.
_SNAP = 5e-3


def _num_train_timesteps(scheduler: Any) -> float:
    config = getattr(scheduler, "config", None) or {}
    return float(config.get("num_train_timesteps", 1000) or 1000)


class TimestepNormalizer:
    """Turns the value a pipeline hands its transformer into ``t`` in [0, 1] (see module docstring)."""

    def __init__(self, pipe: Any = None, divisor: float | None = None) -> None:
        self._pipe = _weak(pipe) if pipe is not None else None
        self.divisor = check_divisor(divisor)
        self._host: tuple[int, list[float]] | None = None

    def _scheduler_timesteps(self) -> tuple[list[float], float] | None:
        pipe = self._pipe() if self._pipe is not None else None
        scheduler = getattr(pipe, "scheduler", None)
        timesteps = getattr(scheduler, "timesteps", None)
        if not isinstance(timesteps, torch.Tensor) or timesteps.numel() == 0:
            return None
        if self._host is None or self._host[0] != id(timesteps):
            self._host = (id(timesteps), [float(x) for x in timesteps.float().cpu().tolist()])  # once per run
        return self._host[1], _num_train_timesteps(scheduler)

    def __call__(self, value: float) -> float:
        if self.divisor is not None:
            return min(max(value / self.divisor, 0.0), 1.0)
        known = self._scheduler_timesteps()
        if known is None:
            n = 1000.0
            t = value / n if value > 1.0 else value
        else:
            timesteps, n = known
            raw = min(timesteps, key=lambda ts: abs(ts - value))
            normalized = min(timesteps, key=lambda ts: abs(ts - value * n))
            is_raw = abs(raw - value) <= abs(normalized - value * n)
            nearest = raw if is_raw else normalized
            t = value / n if is_raw else value
            if abs(nearest / n - t) <= _SNAP:
                t = nearest / n  # the scheduler's exact value, not its float32/bf16 rounding
        return min(max(t, 0.0), 1.0)


def _weak(obj: Any) -> Callable[[], Any]:
    """A weak reference where the object allows one, else a plain one."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def check_divisor(divisor: Any) -> float | None:
    """``timestep_divisor``: None (detect) or a finite number > 0."""
    if divisor is None:
        return None
    if isinstance(divisor, bool) or not isinstance(divisor, (int, float)):
        raise ControlTypeError(
            f"timestep_divisor must be a number (1 or num_train_timesteps, e.g. 1000) or None; "
            f"got {divisor!r} ({type(divisor).__name__})."
        )
    if not (math.isfinite(divisor) and divisor > 0):
        raise ValueError(f"timestep_divisor must be finite and > 0 (1 or num_train_timesteps) or None; got {divisor!r}.")
    return float(divisor)


def check_processor(processor: Any, where: str) -> None:
    """``processor`` must be what ``set_timestep`` is published to: a ``TrtllmAttnProcessor``."""
    if not callable(getattr(processor, "set_timestep", None)):
        raise ControlTypeError(
            f"{where} needs the TrtllmAttnProcessor installed on the transformer; got {type(processor).__name__}."
        )


class _DenoiseTrackingHook(ModelHook):
    """Hands each forward's ``timestep`` tensor to the processor before the forward runs."""

    def __init__(self, processor: Any, normalizer: TimestepNormalizer, timestep_index: int | None) -> None:
        super().__init__()
        self.processor = processor
        self.normalizer = normalizer
        self.timestep_index = timestep_index

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any):
        timestep = kwargs.get("timestep")
        if timestep is None and self.timestep_index is not None and self.timestep_index < len(args):
            timestep = args[self.timestep_index]
        if isinstance(timestep, torch.Tensor):
            self.processor._t_tensor = timestep
            self.processor._t_normalizer = self.normalizer
        elif isinstance(timestep, (int, float)):
            self.processor._t_tensor = None
            self.processor._t_value = self.normalizer(float(timestep))
        return args, kwargs


def _transformers(target: Any) -> list[torch.nn.Module]:
    if isinstance(target, torch.nn.Module):
        return [target]
    found = [getattr(target, a, None) for a in _TRANSFORMER_ATTRS]
    found = [m for m in found if isinstance(m, torch.nn.Module)]
    if not found:
        raise ControlTypeError(
            f"{type(target).__name__} has no transformer to track (looked for {', '.join(_TRANSFORMER_ATTRS)}); "
            "pass a pipeline or a transformer module."
        )
    return found


def attach_denoise_tracking(target: Any, processor: Any, timestep_divisor: float | None = None) -> Any:
    """Publish every step's normalized ``t`` to ``processor`` before that step's transformer forward.

    ``target``: a pipeline (hooks ``transformer`` and ``transformer_2``) or a transformer.
    ``timestep_divisor``: force the normalization (1 if the transformer gets ``t`` in [0, 1],
    ``num_train_timesteps`` if raw); by default it is detected against ``pipe.scheduler``.
    Returns ``target``. Attaching twice replaces the earlier hook.
    """
    check_processor(processor, "attach_denoise_tracking")
    transformers = _transformers(target)
    pipe = None if isinstance(target, torch.nn.Module) else target
    normalizer = TimestepNormalizer(pipe, timestep_divisor)
    for transformer in transformers:
        params = list(inspect.signature(transformer.forward).parameters)
        index = params.index("timestep") if "timestep" in params else None
        registry = HookRegistry.check_if_exists_or_initialize(transformer)
        if registry.get_hook(HOOK_NAME) is not None:
            registry.remove_hook(HOOK_NAME, recurse=False)
        registry.register_hook(_DenoiseTrackingHook(processor, normalizer, index), HOOK_NAME)
    return target


def detach_denoise_tracking(target: Any) -> None:
    """Remove the hooks ``attach_denoise_tracking`` added."""
    for transformer in _transformers(target):
        registry = getattr(transformer, "_diffusers_hook", None)
        if registry is not None and registry.get_hook(HOOK_NAME) is not None:
            registry.remove_hook(HOOK_NAME, recurse=False)


class DenoiseStepCallback(PipelineCallback):
    """``callback_on_step_end`` that publishes the next step's normalized ``t`` to the processor.

    Works alone (the first step then runs dense) or inside ``MultiPipelineCallbacks``;
    with ``attach_denoise_tracking`` as well, the hook's reading wins.
    """

    tensor_inputs: list[str] = []

    def __init__(self, processor: Any, on_step: Callable[[int, float | None], None] | None = None) -> None:
        super().__init__()
        check_processor(processor, "DenoiseStepCallback")
        if on_step is not None and not callable(on_step):
            raise ControlTypeError(f"on_step must be a callable (step_index, t) or None; got {on_step!r}.")
        self.processor = processor
        self.on_step = on_step
        processor._has_callback = True

    def callback_fn(self, pipeline: Any, step_index: int, timestep: Any, callback_kwargs: dict) -> dict:
        scheduler = pipeline.scheduler
        timesteps = scheduler.timesteps
        nxt = step_index + 1
        t_next = None
        if nxt < len(timesteps):
            t_next = min(max(float(timesteps[nxt]) / _num_train_timesteps(scheduler), 0.0), 1.0)
        # After the last step nothing is known until the next run's first callback.
        self.processor.set_timestep(t_next)
        if self.on_step is not None:
            self.on_step(step_index, t_next)
        return callback_kwargs
