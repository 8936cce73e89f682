"""Telling each transformer's layers which denoising step they are in, for ``disabled_until_timestep``.

The timestep belongs to the transformer being run: each transformer (or the
transformers of one pipeline) has a :class:`TimestepTracker` that its layers read
inside the attention op. Its sources, usable together:

- The transformer's own ``timestep`` argument, which every pipeline passes on every step: a forward
  pre-hook (:class:`TimestepHook`) hands it to the tracker *before* that forward runs, so every step,
  the first included, is gated right. ``install(pipe, proc)`` and ``transformer.set_attn_processor(proc)``
  put it on (:func:`follow_timesteps`); ``uninstall``, or a processor of another kind replacing ours, take
  it off. ``attach_denoise_tracking(pipe)`` puts the same hook on explicitly (a custom loop, a forced
  ``timestep_divisor``) and replaces the automatic one, so there is one hook per transformer, never two.
  The hook only stores the tensor; its value is read inside our attention op (one sync per forward),
  so ``torch.compile`` sees no graph break. A timestep of several values (per sample, or Wan 2.2 TI2V's
  ``[batch, tokens]``) counts as its noisiest (largest ``t``): skip-softmax starts only when every sample
  and token is past the gate. After ``detach_denoise_tracking`` gated layers run dense (one warning).
  It is torch's hook, not a Diffusers ``HookRegistry`` entry: a registry's wrapped ``forward`` is a local
  closure, which ``pickle`` refuses and ``copy.deepcopy`` would share with the copy.
- ``DenoiseStepCallback(proc)``: a ``PipelineCallback`` for ``callback_on_step_end``
  (alone or in ``MultiPipelineCallbacks``). Diffusers calls it after a step, so it
  publishes the *next* step's ``t``; the first step runs dense (right whenever
  ``disabled_until_timestep`` is below the first ``t``, as it is in practice).

Normalization: ``t = timestep / scheduler.config.num_train_timesteps`` in [0, 1] (1 = noise).
How a family's pipeline hands its transformer the timestep is read from Diffusers 0.42.1's pipelines
(:data:`FAMILY_TIMESTEPS`): Flux, Flux2, Chroma and Qwen-Image hand it ``t`` itself (``timestep / 1000``);
Wan, SD3, HunyuanVideo, LTX-Video and CogVideoX the raw timestep; Lumina 2 and Z-Image ``1 - t``.
Other families are told apart per call by which reading lies nearer the scheduler's own timestep
list: the raw value itself (then divide) or the value times ``num_train_timesteps``
(already normalized); without a scheduler (``set_attn_processor`` on the transformer alone),
"above 1 means raw".
"""

from __future__ import annotations

import inspect
import math
import weakref
from typing import Any, Callable

import torch
from diffusers.callbacks import PipelineCallback

from ..config import ControlTypeError
from .layer import check_calibrated, layer_of
from .modules import denoisers, target_modules, uncompiled

__all__ = [
    "DenoiseStepCallback", "attach_denoise_tracking", "detach_denoise_tracking", "TimestepNormalizer", "TimestepTracker",
    "TimestepHook", "FAMILY_TIMESTEPS", "tracker_of", "detach_tracker", "tracking_hook", "follow_timesteps",
    "stop_following_timesteps",
]

#: How each family's pipeline hands its transformer the timestep, by transformer class (Diffusers 0.42.1's
#: pipelines): ``"t"``: t itself (``timestep / 1000``), ``"raw"``: the scheduler's timestep (t times
#: ``num_train_timesteps``), ``"1-t"``: 1 - t (0 = noise).
FAMILY_TIMESTEPS: dict[str, str] = {
    "FluxTransformer2DModel": "t", "Flux2Transformer2DModel": "t", "ChromaTransformer2DModel": "t",
    "QwenImageTransformer2DModel": "t",
    "WanTransformer3DModel": "raw", "WanVACETransformer3DModel": "raw", "SD3Transformer2DModel": "raw",
    "HunyuanVideoTransformer3DModel": "raw", "LTXVideoTransformer3DModel": "raw", "CogVideoXTransformer3DModel": "raw",
    "Lumina2Transformer2DModel": "1-t", "ZImageTransformer2DModel": "1-t",
}
#: The transformer's ``forward`` parameter carrying the timestep (HiDream's is ``timesteps``).
_TIMESTEP_PARAMS = ("timestep", "timesteps")
#: A reading this close (in t) to a scheduler timestep is that timestep.
_SNAP = 5e-3


def _num_train_timesteps(scheduler: Any) -> float:
    config = getattr(scheduler, "config", None) or {}
    return float(config.get("num_train_timesteps", 1000) or 1000)


class TimestepNormalizer:
    """Turns the value a pipeline hands its transformer into ``t`` in [0, 1] (see module docstring).

    ``convention``: the family's (:data:`FAMILY_TIMESTEPS`), else None (told apart per call); ``divisor``
    (``attach_denoise_tracking``'s ``timestep_divisor``) wins over both."""

    def __init__(self, pipe: Any = None, divisor: float | None = None, convention: str | None = None) -> None:
        self._pipe = _weak(pipe) if pipe is not None else None
        self.divisor = check_divisor(divisor)
        self.convention = convention
        self._host: tuple[int, list[float]] | None = None

    @property
    def has_pipeline(self) -> bool:
        return self._pipe is not None

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
        n = known[1] if known is not None else 1000.0
        if self.convention is not None:
            t = {"t": value, "raw": value / n, "1-t": 1.0 - value}[self.convention]
        elif known is None:
            t = value / n if value > 1.0 else value
        else:
            timesteps = known[0]
            raw = min(timesteps, key=lambda ts: abs(ts - value))
            normalized = min(timesteps, key=lambda ts: abs(ts - value * n))
            t = value / n if abs(raw - value) <= abs(normalized - value * n) else value
        if known is not None:
            nearest = min(known[0], key=lambda ts: abs(ts / n - t))
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
        """``t`` of the forward in flight: from the hook's tensor (its noisiest entry: per-token timesteps
        keep the noise level of the tokens being generated, a batch is gated by its noisiest sample) or the
        published value."""
        if tensor is None or self.normalizer is None:
            return self.value
        hit = self._cache
        if hit is not None and hit[0]() is tensor:
            return hit[1]
        values = tensor.detach().float()
        ends = torch.stack((values.min(), values.max())).tolist()  # one sync per transformer forward
        t = max(self.normalizer(v) for v in ends)  # the noisiest (a family may hand 1 - t)
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


class TimestepHook:
    """A forward pre-hook of the transformer (torch's, with keywords): hands each forward's ``timestep`` to the
    transformer's tracker before the forward runs, and refuses there, before any layer runs, a
    ``target_sparsity`` no calibration backs (eager forwards; a compiled one fails at its first layer).
    ``automatic``: put on by installing our processor (then replaced by ``attach_denoise_tracking``, and taken
    off with the processor), else by the user."""

    def __init__(self, tracker: TimestepTracker, param: tuple[str, int] | None, automatic: bool) -> None:
        self.tracker = tracker
        self.param = param
        self.automatic = automatic
        self.handle: Any = None

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.compiler.is_compiling():
            check_calibrated(module)
        timestep = None
        if self.param is not None:
            name, index = self.param
            timestep = kwargs.get(name, args[index] if index < len(args) else None)
        if isinstance(timestep, torch.Tensor):
            self.tracker.hand_over(timestep)
        else:
            self.tracker.hand_over(None)  # never the tensor of an earlier forward
            if isinstance(timestep, (int, float)) and not isinstance(timestep, bool):
                self.tracker.publish(self.tracker.normalizer(float(timestep)))
        return None


HOOK_ATTR = "_trtllm_timestep_hook"


def tracking_hook(transformer: torch.nn.Module) -> TimestepHook | None:
    """The timestep hook on ``transformer`` (automatic or ``attach_denoise_tracking``'s), or None."""
    return uncompiled(transformer).__dict__.get(HOOK_ATTR)


def _timestep_param(transformer: torch.nn.Module) -> tuple[str, int] | None:
    """The name and position (after ``self``) of ``forward``'s timestep parameter, or None if it has none."""
    params = list(inspect.signature(transformer.forward).parameters)
    return next(((name, params.index(name)) for name in _TIMESTEP_PARAMS if name in params), None)


def _hook(transformers: list[torch.nn.Module], pipe: Any, divisor: float | None, automatic: bool) -> None:
    """Put one timestep hook on each of ``transformers`` (replacing any there), all feeding one tracker."""
    model = uncompiled(transformers[0])
    normalizer = TimestepNormalizer(pipe, divisor, FAMILY_TIMESTEPS.get(type(model).__name__))
    tracker = tracker_of(transformers[0])
    for transformer in transformers:
        tracker_of(transformer, tracker)
        _remove_hook(transformer)
        model = uncompiled(transformer)
        hook = TimestepHook(tracker, _timestep_param(model), automatic)
        hook.handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        model.__dict__[HOOK_ATTR] = hook
    tracker.normalizer = normalizer
    tracker.detached = False


def follow_timesteps(transformers: list[torch.nn.Module], pipe: Any = None) -> None:
    """Our processor now serves ``transformers`` (one pipeline's, or one model): read their ``timestep`` on every
    forward. A hook the user attached stays; an automatic one is renewed only to learn the pipeline's scheduler."""
    hooks = [tracking_hook(t) for t in transformers]
    if any(h is not None and not h.automatic for h in hooks):
        return
    learned = pipe is None or all(h.tracker.normalizer is not None and h.tracker.normalizer.has_pipeline
                                  for h in hooks if h is not None)
    if all(h is not None for h in hooks) and learned:
        return
    _hook(transformers, pipe, None, automatic=True)


def stop_following_timesteps(transformer: torch.nn.Module) -> None:
    """No layer of ``transformer`` is ours any more: take off the hook our processor put on (not the user's)."""
    hook = tracking_hook(transformer)
    if hook is not None and hook.automatic:
        _remove_hook(transformer)


def attach_denoise_tracking(target: Any, processor: Any = None, timestep_divisor: float | None = None) -> Any:
    """Publish every step's normalized ``t`` to the layers of ``target`` before that step's transformer forward.

    Installing the processor does this already (the transformer's own ``timestep`` argument, normalized per
    family); call this for a custom loop, or to force ``timestep_divisor``. ``target``: a pipeline (hooks
    each of its denoisers, ``serving.modules``: Wan 2.2's ``transformer`` and ``transformer_2`` then share
    one step count) or a transformer. ``processor`` is accepted for compatibility: the timestep
    belongs to the transformer, whichever processor serves it.
    ``timestep_divisor``: force the normalization (1 if the transformer gets ``t`` in [0, 1],
    ``num_train_timesteps`` if raw); by default the family's convention, else detected against ``pipe.scheduler``.
    Returns ``target``. Attaching twice replaces the earlier hook, and the one installing put on.
    """
    if processor is not None:
        check_processor(processor, "attach_denoise_tracking")
    transformers = list(target_modules(target, "track").values())
    pipe = None if isinstance(target, torch.nn.Module) else target
    _hook(transformers, pipe, timestep_divisor, automatic=False)
    return target


def detach_denoise_tracking(target: Any, by_user: bool = True) -> None:
    """Remove the timestep hooks (``attach_denoise_tracking``'s, or the ones installing put on); gated layers
    then run dense (one warning, unless ``DenoiseStepCallback`` publishes ``t``). ``by_user=False``: no
    warning (a library removing its own hook)."""
    for transformer in target_modules(target, "track").values():
        _remove_hook(transformer)
        tracker = transformer.__dict__.get(TRACKER_ATTR)
        if tracker is not None:
            tracker.detach(by_user)


def _remove_hook(transformer: torch.nn.Module) -> None:
    hook = uncompiled(transformer).__dict__.pop(HOOK_ATTR, None)
    if hook is not None:
        hook.handle.remove()


def detach_tracker(transformer: torch.nn.Module) -> None:
    """Forget ``transformer``'s tracker and its timestep hook (``uninstall``)."""
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
