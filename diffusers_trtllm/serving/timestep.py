"""Telling each transformer's layers which denoising step they are in, for ``disabled_until_timestep``.

The timestep belongs to the transformer being run: each transformer (or the
transformers of one pipeline) has a :class:`TimestepTracker` that its layers read
inside the attention op. Two ways to feed it, usable together:

- ``attach_denoise_tracking(pipe)``: a Diffusers ``ModelHook`` on each
  denoiser (``serving.modules``: ``transformer``, ``transformer_2``, ``unet``, ...) hands the ``timestep`` argument
  of every forward to the tracker *before* that forward runs, so every step,
  the first included, is gated right. The hook only stores the tensor; its value
  is read inside our attention op (one sync per forward), so ``torch.compile``
  sees no graph break. A ``[batch, tokens]`` timestep (Wan 2.2 TI2V) counts by its
  largest entry. After ``detach_denoise_tracking`` gated layers run dense (one warning).
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

from ..config import ControlTypeError
from .layer import layer_of
from .modules import denoisers, target_modules

__all__ = [
    "DenoiseStepCallback", "attach_denoise_tracking", "detach_denoise_tracking", "TimestepNormalizer", "TimestepTracker",
    "tracker_of", "detach_tracker", "tracking_hook",
]

HOOK_NAME = "diffusers_trtllm.denoise_tracking"
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

    def __getstate__(self) -> dict:
        # The pipeline is held weakly (not picklable); a copy normalizes without its scheduler.
        return {**self.__dict__, "_pipe": None, "_host": None}

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


    def step_of(self, t: float) -> int | None:
        """The pipeline's step computing ``t``: its place in the scheduler's timesteps (None without a scheduler,
        or off its list). Steps whose attention a cache skipped keep their numbers this way."""
        known = self._scheduler_timesteps()
        if known is None:
            return None
        timesteps, n = known
        index = min(range(len(timesteps)), key=lambda i: abs(timesteps[i] / n - t))
        return index if abs(timesteps[index] / n - t) <= _SNAP else None


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


class TimestepTracker:
    """The denoising timestep of the transformer(s) it belongs to, and the step count of their run.

    One tracker serves one transformer, or every transformer of one pipeline (Wan 2.2's
    two experts share their steps). Layers read it inside the attention op; nothing
    about a call is process-wide, so models in different threads never see each
    other's ``t``. Set by the tracking hook (a tensor, read once per forward), by
    ``DenoiseStepCallback`` or ``TrtllmAttnProcessor.set_timestep`` (a float).
    """

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        self.normalizer: TimestepNormalizer | None = None
        self.value: float | None = None
        self.detached = False
        #: Run counter: bumped when t rises or a run ended (a new pipeline run), so layer statistics restart.
        self.run = 0
        self.step = 0
        self._calls_in_step = 0
        self._last_t: float | None = None
        self._cache: tuple | None = None
        #: A callback or ``set_timestep`` has published a ``t`` (so steps are counted, not calls).
        self._published = False
        #: The callback saw a run's last step: the next call starts a new run at step 0.
        self._run_ended = False

    def __getstate__(self) -> dict:
        # The tensor and its cache belong to a forward in flight.
        return {**self.__dict__, "tensor": None, "_cache": None}

    def publish(self, t: float | None) -> None:
        """A normalized ``t`` for the next forwards (callback or user), or None for "unknown"."""
        self.value = t
        self._published = True
        self.detached = False  # a timestep source is back
        if t is not None:
            self._observe(t)

    def end_run(self) -> None:
        """The run's last step is done (the callback knows no next ``t``): the next call is step 0 of a new run."""
        self.publish(None)
        self._run_ended = True

    def _start_run_if_ended(self) -> None:
        if self._run_ended:
            self._run_ended = False
            self.reset()

    def read(self, tensor: torch.Tensor | None) -> float | None:
        """``t`` of the forward in flight: from the hook's tensor (the largest entry: per-token timesteps
        keep the noise level of the tokens being generated) or the published value."""
        if tensor is None or self.normalizer is None:
            return self.value
        hit = self._cache
        if hit is not None and hit[0]() is tensor:
            return hit[1]
        t = self.normalizer(float(tensor.detach().max()))  # one sync per transformer forward
        self._cache = (weakref.ref(tensor), t)
        self._observe(t)
        return t

    def hand_over(self, tensor: torch.Tensor | None) -> None:
        """The ``timestep`` tensor of the forward about to run (read once, by its first served call).

        The reading is cached for that forward only, so no version counter is needed (tensors made
        under ``torch.inference_mode()`` have none) and a tensor edited in place between two
        forwards is read again."""
        self.tensor = tensor
        self._cache = None

    def _observe(self, t: float) -> None:
        """Number the step of ``t``: the pipeline's (the scheduler's place of ``t``) where known, else the next one
        when t changes; a rising t starts a new run."""
        self._start_run_if_ended()
        last = self._last_t
        step = self.normalizer.step_of(t) if self.normalizer is not None else None
        if last is not None and t > last + 1e-6:
            self.reset()
        elif step is None and t != last and self._calls_in_step:
            step = self.step + 1
        if step is not None and step != self.step:
            self.step = step
            self._calls_in_step = 0
        self._last_t = t

    def count_call(self) -> int | None:
        """Count one served call; its step, or None when no timestep was ever seen (untimed)."""
        self._start_run_if_ended()
        self._calls_in_step += 1
        return self.step if self.timed else None

    @property
    def timed(self) -> bool:
        """Whether a timestep source is attached (hook) or was ever published (callback)."""
        return self.normalizer is not None or self._published

    def reset(self) -> None:
        """Start a new run: step 0, statistics of its layers start afresh."""
        self.run += 1
        self.step = 0
        self._calls_in_step = 0
        self._last_t = None

    def detach(self, by_user: bool = True) -> None:
        """Forget the hook's source; ``by_user``: the user detached it (gated layers then say so once), else
        the tracker is as if never attached (``calibrate()`` removing the hook it added)."""
        self.tensor = None
        self.normalizer = None
        self.value = None
        self.detached = by_user
        self.reset()


TRACKER_ATTR = "_trtllm_tracker"


def tracker_of(transformer: torch.nn.Module, shared: TimestepTracker | None = None) -> TimestepTracker:
    """The transformer's tracker (created, or ``shared`` adopted), linked to every layer it holds."""
    tracker = shared or transformer.__dict__.get(TRACKER_ATTR) or TimestepTracker()
    transformer.__dict__[TRACKER_ATTR] = tracker
    for module in transformer.modules():
        state = layer_of(module)
        if state is not None:
            state.tracker = tracker
    return tracker


class _DenoiseTrackingHook(ModelHook):
    """Hands each forward's ``timestep`` tensor to the transformer's tracker before the forward runs."""

    def __init__(self, tracker: TimestepTracker, timestep_index: int | None) -> None:
        super().__init__()
        self.tracker = tracker
        self.timestep_index = timestep_index

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any):
        timestep = kwargs.get("timestep")
        if timestep is None and self.timestep_index is not None and self.timestep_index < len(args):
            timestep = args[self.timestep_index]
        if isinstance(timestep, torch.Tensor):
            self.tracker.hand_over(timestep)
        elif isinstance(timestep, (int, float)):
            self.tracker.hand_over(None)
            self.tracker.publish(self.tracker.normalizer(float(timestep)))
        return args, kwargs


def attach_denoise_tracking(target: Any, processor: Any = None, timestep_divisor: float | None = None) -> Any:
    """Publish every step's normalized ``t`` to the layers of ``target`` before that step's transformer forward.

    ``target``: a pipeline (hooks each of its denoisers, ``serving.modules``: Wan 2.2's
    ``transformer`` and ``transformer_2`` then share one step count) or a transformer. ``processor`` is accepted for compatibility: the timestep
    belongs to the transformer, whichever processor serves it.
    ``timestep_divisor``: force the normalization (1 if the transformer gets ``t`` in [0, 1],
    ``num_train_timesteps`` if raw); by default it is detected against ``pipe.scheduler``.
    Returns ``target``. Attaching twice replaces the earlier hook.
    """
    if processor is not None:
        check_processor(processor, "attach_denoise_tracking")
    transformers = list(target_modules(target, "track").values())
    pipe = None if isinstance(target, torch.nn.Module) else target
    normalizer = TimestepNormalizer(pipe, timestep_divisor)
    tracker = tracker_of(transformers[0])
    for transformer in transformers:
        tracker_of(transformer, tracker)
        params = list(inspect.signature(transformer.forward).parameters)
        index = params.index("timestep") if "timestep" in params else None
        _remove_hook(transformer)
        registry = HookRegistry.check_if_exists_or_initialize(transformer)
        registry.register_hook(_DenoiseTrackingHook(tracker, index), HOOK_NAME)
    tracker.normalizer = normalizer
    tracker.detached = False
    return target


def detach_denoise_tracking(target: Any, by_user: bool = True) -> None:
    """Remove the hooks ``attach_denoise_tracking`` added; gated layers then run dense (one warning, unless
    ``DenoiseStepCallback`` publishes ``t``). ``by_user=False``: no warning (a library removing its own hook)."""
    for transformer in target_modules(target, "track").values():
        _remove_hook(transformer)
        tracker = transformer.__dict__.get(TRACKER_ATTR)
        if tracker is not None:
            tracker.detach(by_user)


def _remove_hook(transformer: torch.nn.Module) -> None:
    registry = getattr(transformer, "_diffusers_hook", None)
    if registry is not None and registry.get_hook(HOOK_NAME) is not None:
        registry.remove_hook(HOOK_NAME, recurse=False)


def tracking_hook(transformer: torch.nn.Module) -> ModelHook | None:
    """The tracking hook ``attach_denoise_tracking`` put on ``transformer``, or None."""
    registry = getattr(transformer, "_diffusers_hook", None)
    return registry.get_hook(HOOK_NAME) if registry is not None else None


def detach_tracker(transformer: torch.nn.Module) -> None:
    """Forget ``transformer``'s tracker and its tracking hook (``uninstall``)."""
    transformer.__dict__.pop(TRACKER_ATTR, None)
    _remove_hook(transformer)


class DenoiseStepCallback(PipelineCallback):
    """``callback_on_step_end`` that publishes the next step's normalized ``t`` to the pipeline's denoisers.

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
        processor._attach_step_callback()

    def callback_fn(self, pipeline: Any, step_index: int, timestep: Any, callback_kwargs: dict) -> dict:
        scheduler = pipeline.scheduler
        timesteps = scheduler.timesteps
        nxt = step_index + 1
        t_next = None
        if nxt < len(timesteps):
            t_next = min(max(float(timesteps[nxt]) / _num_train_timesteps(scheduler), 0.0), 1.0)
        # After the last step nothing is known until the next run's first callback.
        if t_next is not None and not 0.0 <= t_next <= 1.0:
            raise ValueError(f"t must be a normalized timestep in [0, 1]; got {t_next!r}.")
        try:
            transformers = list(denoisers(pipeline).values())
        except ValueError:
            transformers = []
        if transformers:
            tracker = tracker_of(transformers[0])
            for transformer in transformers[1:]:
                tracker_of(transformer, tracker)
            if t_next is None:
                tracker.end_run()
            else:
                tracker.publish(t_next)
        else:
            self.processor.set_timestep(t_next)
        if self.on_step is not None:
            self.on_step(step_index, t_next)
        return callback_kwargs
