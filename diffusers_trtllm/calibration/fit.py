"""``calibrate()``: measure where skip-softmax would skip, fit ModelOpt's curve, per layer group.

One dense pipeline run per prompt is enough for every threshold at once: a tile is
skipped when ``exp(local_max - running_max) < lambda`` for all its rows, and a skipped
tile never raises the running max (its maximum lies below it, ``lambda <= 1``), so the
dense running max is the one a sparse run would see and each tile's *critical* value
(``measure.tile_criticals``) says at which ``lambda`` it starts being skipped.
Multiplied by the sequence's KV length it becomes a critical *factor*
(``lambda = factor / kv_len``), the quantity ModelOpt's curve speaks of.

Per layer and step the measurement keeps, for every threshold of the sweep, the tiles
a ``skip_softmax_threshold`` of that value would skip (``factor = threshold * max_kv_len``).
A group of layers (one per transformer by default: Wan 2.2's two experts get their own
curves) pools its layers and active steps into one sparsity-versus-factor curve ``S(F)``,
and ``log F = log a + b * s`` is fitted by least squares to the factors that reach evenly
spaced sparsities ``s`` inside ``fit_range``: ``factor = a * exp(b * target_sparsity)``.

What a sparse run then skips differs from this prediction only because skipping changes
the activations of later layers and steps; the tests measure that gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from .._logging import logger
from ..config import GROUP_BY, check_fit_range
from ..layout import MaskNotSupportedError
from ..measure import tile_criticals
from ..serving.processor import TrtllmAttnProcessor
from ..serving.layer import layer_of
from ..serving.modules import denoisers
from ..serving.timestep import attach_denoise_tracking, detach_denoise_tracking, tracking_hook
from .checkpoint import sparse_attention_config

__all__ = ["calibrate", "SparsityCalibration", "FittedGroup", "LayerStepSparsity", "DEFAULT_THRESHOLDS", "GROUP_BY"]

#: Thresholds (lambda at the longest KV sequence) measured by default: 1e-8 .. 1, 12 per decade.
DEFAULT_THRESHOLDS: tuple[float, ...] = tuple(float(x) for x in np.geomspace(1e-8, 1.0, 97))


@dataclass
class LayerStepSparsity:
    """Tiles one layer would skip at one denoising step, for every threshold of the sweep (summed over prompts)."""

    transformer: str
    layer: str
    role: str
    step: int
    t: float | None
    kv_len: int
    tiles: int = 0
    skipped: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def fractions(self) -> np.ndarray:
        return self.skipped / self.tiles if self.tiles else np.zeros_like(self.skipped, dtype=float)


@dataclass(frozen=True)
class FittedGroup:
    """One fitted curve ``factor = a * exp(b * s)`` and the layers it covers."""

    name: str
    transformer: str
    a: float
    b: float
    layers: tuple[str, ...]
    targets: tuple[str, ...] | None  # None: every layer of the transformer
    observed: tuple[float, float]  # sparsity range the measurement spans
    fit_error: float  # max |S(a * exp(b * s)) - s| over the fitted sparsities, on the measured curve
    steps: tuple[int, ...]  # steps pooled (the active ones)

    def factor(self, target_sparsity: float) -> float:
        return self.a * math.exp(self.b * target_sparsity)


@dataclass
class SparsityCalibration:
    """What ``calibrate`` measured and fitted; ``save_calibration`` writes it as ModelOpt's JSON."""

    thresholds: tuple[float, ...]
    measurements: list[LayerStepSparsity]
    groups: dict[str, list[FittedGroup]]
    target_sparsity: float | None = None
    disabled_until_timestep: float = 0.0
    tile: tuple[int, int] = (128, 128)

    def config(self) -> dict[str, Any]:
        """ModelOpt's ``sparse_attention_config`` (one per transformer when there are two)."""
        per = {
            attr: {"sparse_attention_config": sparse_attention_config(
                [(g.name, g.a, g.b, g.targets, (round(g.observed[0], 4), round(g.observed[1], 4))) for g in groups],
                target_sparsity=self.target_sparsity, disabled_until_timestep=self.disabled_until_timestep)}
            for attr, groups in self.groups.items()
        }
        return per["transformer"] if list(per) == ["transformer"] else per

    def table(self) -> list[dict[str, Any]]:
        """One row per layer, step and threshold (a long table: ``pandas.DataFrame(cal.table())``)."""
        return [
            {"transformer": m.transformer, "layer": m.layer, "role": m.role, "step": m.step, "t": m.t,
             "kv_len": m.kv_len, "threshold": thr, "skipped_fraction": float(f)}
            for m in self.measurements for thr, f in zip(self.thresholds, m.fractions())
        ]

    def predicted_sparsity(self, target_sparsity: float, transformer: str = "transformer", group: int = 0) -> float:
        """Skipped fraction the dense measurement gives at the fitted factor for ``target_sparsity``."""
        fitted = self.groups[transformer][group]
        log_f, sparsity = _group_curve(self._members(fitted), self.thresholds)
        return float(np.interp(math.log(fitted.factor(target_sparsity)), log_f, sparsity))

    def _members(self, fitted: FittedGroup) -> list[LayerStepSparsity]:
        layers, steps = set(fitted.layers), set(fitted.steps)
        return [m for m in self.measurements
                if m.transformer == fitted.transformer and m.layer in layers and m.step in steps]

    def format(self) -> str:
        lines = []
        for attr, groups in self.groups.items():
            for g in groups:
                lines.append(
                    f"{attr}:{g.name}  a={g.a:.6g}  b={g.b:.4f}  layers={len(g.layers)}  steps={len(g.steps)}  "
                    f"observed sparsity {g.observed[0]:.3f}..{g.observed[1]:.3f}  fit error {g.fit_error:.4f}"
                )
        return "\n".join(lines)


class _Recorder(TrtllmAttnProcessor):
    """A dense processor that also measures every call's tile criticals (the calibration pass)."""

    def __init__(self, thresholds: Sequence[float], tile: tuple[int, int], owners: dict[int, str], backend: str) -> None:
        super().__init__(backend=backend)
        self.thresholds = torch.tensor(thresholds, dtype=torch.float64)
        self.tile = tile
        self.owners = owners
        self.cells: dict[tuple, LayerStepSparsity] = {}
        self._call_observer = self._measure

    def _settings_for(self, state):
        return self._role_settings[state.role]  # dense, whatever calibration the layer carries

    @torch.no_grad()
    def _measure(self, state, t, layout, query, key, scale) -> None:
        q, k = layout.pack_q(query), layout.pack_kv(key)
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
        scale = scale if scale is not None else query.shape[-1] ** -0.5
        criticals, tiles = [], 0
        q0 = k0 = 0
        for lq, lkv in zip(layout.q_lens, layout.kv_lens):
            if lq and lkv:
                crit = tile_criticals(q[q0:q0 + lq], k[k0:k0 + lkv], scale, *self.tile)
                criticals.append((crit.double() * lkv).flatten())  # critical factors
                tiles += crit.shape[0] * crit.shape[1] * (crit.shape[2] + 1)
            q0, k0 = q0 + lq, k0 + lkv
        factors = torch.sort(torch.cat(criticals).cpu()).values if criticals else torch.zeros(0, dtype=torch.float64)
        skipped = torch.searchsorted(factors, self.thresholds * layout.max_seqlen_kv, side="left").numpy()
        tracker = state.tracker
        step = tracker.step if tracker is not None and tracker.timed else state.calls  # untimed: the n-th call
        transformer = self.owners.get(id(state), "transformer")
        cell_key = (transformer, state.label, step, layout.max_seqlen_kv)
        cell = self.cells.get(cell_key)
        if cell is None:
            cell = self.cells[cell_key] = LayerStepSparsity(
                transformer, state.label, state.role, step, t, layout.max_seqlen_kv,
                skipped=np.zeros(len(self.thresholds), dtype=np.int64))
        cell.tiles += tiles
        cell.skipped += skipped


def _transformers(pipe: Any) -> dict[str, torch.nn.Module]:
    if isinstance(pipe, torch.nn.Module):
        raise ValueError("calibrate() runs a pipeline; pass the pipeline, not its transformer.")
    return denoisers(pipe, "calibrate")


def _check_thresholds(thresholds: Iterable[float]) -> tuple[float, ...]:
    values = tuple(float(x) for x in thresholds)
    if len(values) < 2 or any(not 0.0 < v <= 1.0 for v in values) or list(values) != sorted(set(values)):
        raise ValueError(
            "thresholds must be at least two increasing values in (0, 1] (a threshold above 1 would skip tiles "
            f"that raise the running max); got {values[:6]}{'...' if len(values) > 6 else ''}."
        )
    return values


def _group_curve(members: list[LayerStepSparsity], thresholds: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Pooled skipped fraction ``S`` over a common grid of ``log factor`` (layers may differ in KV length)."""
    thr = np.log(np.asarray(thresholds))
    grid = np.unique(np.concatenate([thr + math.log(m.kv_len) for m in members]))
    skipped = np.zeros_like(grid)
    tiles = 0
    for m in members:
        skipped += np.interp(grid, thr + math.log(m.kv_len), m.skipped.astype(float))
        tiles += m.tiles
    return grid, skipped / max(tiles, 1)


def _fit(log_f: np.ndarray, sparsity: np.ndarray, fit_range: tuple[float, float], where: str):
    """Least squares ``log F = log a + b s`` at evenly spaced sparsities inside the measured range."""
    lo, hi = max(fit_range[0], float(sparsity[0])), min(fit_range[1], float(sparsity[-1]))
    if hi - lo < 0.05:
        raise ValueError(
            f"{where}: the measured skipped fraction only spans {sparsity[0]:.3f}..{sparsity[-1]:.3f} over the "
            f"thresholds swept, too little of fit_range={fit_range} to fit a curve. Attention this flat skips "
            "nothing (random weights do that); calibrate a trained model, widen thresholds, or use longer sequences."
        )
    # Factor at which S first reaches each s (S is non-decreasing; keep the first point of each plateau).
    first = np.concatenate([[True], np.diff(sparsity) > 0])
    targets = np.linspace(lo, hi, 25)
    log_targets = np.interp(targets, sparsity[first], log_f[first])
    b, log_a = np.polyfit(targets, log_targets, 1)
    log_a, b, error = _refine(log_f, sparsity, targets, float(log_a), float(b))
    return math.exp(log_a), b, error, (float(sparsity[0]), float(sparsity[-1]))


def _refine(log_f: np.ndarray, sparsity: np.ndarray, targets: np.ndarray, log_a: float, b: float):
    """Move the least-squares line to the one whose worst sparsity error over ``targets`` is smallest.

    The least-squares fit is in ``log F``; what a user sees is the sparsity, and a measured
    curve is rarely exactly exponential, so the coefficients are searched (coarse to fine
    grids around the start) for the smallest ``max |S(a * exp(b * s)) - s|``.
    """
    def worst(log_as: np.ndarray, bs: np.ndarray) -> np.ndarray:
        logs = log_as[..., None] + bs[..., None] * targets
        return np.abs(np.interp(logs, log_f, sparsity) - targets).max(axis=-1)

    best = worst(np.array(log_a), np.array(b))
    span_a, span_b = 2.0, max(abs(b), 1.0) * 0.5
    for _ in range(4):
        grid_a, grid_b = np.meshgrid(np.linspace(log_a - span_a, log_a + span_a, 41),
                                     np.linspace(b - span_b, b + span_b, 41), indexing="ij")
        errors = worst(grid_a, grid_b)
        i = np.unravel_index(np.argmin(errors), errors.shape)
        if errors[i] < best:
            best, log_a, b = float(errors[i]), float(grid_a[i]), float(grid_b[i])
        span_a, span_b = span_a / 5, span_b / 5
    return log_a, b, float(best)


def _groups_of(attr: str, cells: list[LayerStepSparsity], group_by: str) -> list[tuple[str, tuple[str, ...] | None, list]]:
    if group_by == "transformer":
        return [("group_0", None, cells)]
    key = (lambda c: c.role) if group_by == "role" else (lambda c: c.layer)
    names = sorted({key(c) for c in cells}, key=lambda n: [c.layer for c in cells if key(c) == n][0])
    out = []
    for i, value in enumerate(names):
        members = [c for c in cells if key(c) == value]
        layers = tuple(dict.fromkeys(c.layer for c in members))
        out.append((f"group_{i}" if group_by == "layer" else value, layers, members))
    return out


def fit_groups(
    measurements: list[LayerStepSparsity],
    thresholds: Sequence[float],
    *,
    group_by: str = "transformer",
    fit_range: tuple[float, float] = (0.1, 0.9),
    disabled_until_timestep: float = 0.0,
) -> dict[str, list[FittedGroup]]:
    """Fit one curve per group of layers, over the steps where skipping would be on."""
    if group_by not in GROUP_BY:
        raise ValueError(f"group_by must be one of {GROUP_BY}; got {group_by!r}.")
    groups: dict[str, list[FittedGroup]] = {}
    for attr in dict.fromkeys(m.transformer for m in measurements):
        cells = [m for m in measurements if m.transformer == attr]
        active = [m for m in cells if not disabled_until_timestep or (m.t is not None and m.t <= disabled_until_timestep)]
        if not active:
            lowest = min((m.t for m in cells if m.t is not None), default=None)
            raise ValueError(
                f"disabled_until_timestep={disabled_until_timestep} gates every step of {attr} (its lowest t was "
                f"{lowest if lowest is None else round(lowest, 4)}), so skip-softmax would never run there and there "
                "is nothing to fit; lower it below that t, or pass 0 (never gated).")
        fitted = []
        for name, layers, members in _groups_of(attr, active, group_by):
            log_f, sparsity = _group_curve(members, thresholds)
            a, b, error, observed = _fit(log_f, sparsity, fit_range, f"{attr} {name}")
            fitted.append(FittedGroup(
                name=name, transformer=attr, a=a, b=b, layers=tuple(dict.fromkeys(m.layer for m in members)),
                targets=layers, observed=observed, fit_error=error, steps=tuple(sorted({m.step for m in members})),
            ))
        groups[attr] = fitted
    return groups


def _pipeline_inputs(prompts: str | Sequence[str | Mapping[str, Any]]) -> list[dict[str, Any]]:
    items = [prompts] if isinstance(prompts, (str, Mapping)) else list(prompts)
    if not items:
        raise ValueError("calibrate() needs at least one prompt (a string, or a dict of pipeline arguments).")
    out = []
    for item in items:
        if isinstance(item, str):
            out.append({"prompt": item})
        elif isinstance(item, Mapping):
            out.append(dict(item))
        else:
            raise ValueError(f"each prompt must be a string or a dict of pipeline arguments; got {type(item).__name__}.")
    return out


@torch.no_grad()
def calibrate(
    pipe: Any,
    prompts: str | Sequence[str | Mapping[str, Any]],
    *,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    steps: int | None = None,
    group_by: str = "transformer",
    fit_range: tuple[float, float] = (0.1, 0.9),
    target_sparsity: float | None = None,
    disabled_until_timestep: float = 0.0,
    tile: tuple[int, int] = (128, 128),
    backend: str = "auto",
    seed: int = 0,
    **pipe_kwargs: Any,
) -> SparsityCalibration:
    """Run ``pipe`` densely on ``prompts`` and fit ``factor = a * exp(b * target_sparsity)`` per layer group.

    ``prompts``: strings, or dicts of pipeline arguments (e.g. ``prompt_embeds`` for a pipeline
    without text encoders); ``pipe_kwargs`` go to every run (``height``, ``width``, ...).
    ``steps``: ``num_inference_steps`` of each run (the pipeline's default when None).
    ``thresholds``: the sweep measured per layer and step (``skip_softmax_threshold`` values).
    ``group_by``: ``"transformer"`` (one curve per transformer; Wan 2.2's experts apart),
    ``"role"`` or ``"layer"`` (groups list their modules in ``targets``).
    ``disabled_until_timestep``: steps with ``t`` above it are left out of the fit (they run dense)
    and the value is written into the calibration with ``target_sparsity``, the recommended
    operating point. ``tile``: the kernel's (query, KV) tile, 128 x 128 for most routes.
    The pipeline's attention processors and timestep tracking are restored afterwards.
    """
    thresholds = _check_thresholds(thresholds)
    fit_range = check_fit_range(fit_range)
    transformers = _transformers(pipe)
    runs = _pipeline_inputs(prompts)
    previous = {attr: m.attn_processors for attr, m in transformers.items() if hasattr(m, "attn_processors")}
    tracked = all(tracking_hook(m) is not None for m in transformers.values())
    recorder = _Recorder(thresholds, tile, {}, backend)
    try:
        for attr, transformer in transformers.items():
            transformer.set_attn_processor(recorder)
            for module in transformer.modules():
                state = layer_of(module)
                if state is not None:
                    recorder.owners[id(state)] = attr
        if not tracked:
            attach_denoise_tracking(pipe)
        for i, run in enumerate(runs):
            recorder.reset_stats()
            kwargs = {"output_type": "latent", **pipe_kwargs, **run}
            if steps is not None:
                kwargs["num_inference_steps"] = steps
            device = getattr(pipe, "_execution_device", torch.device("cpu"))
            kwargs.setdefault("generator", torch.Generator(device).manual_seed(seed + i))
            pipe(**kwargs)
    finally:
        if not tracked:
            detach_denoise_tracking(pipe, by_user=False)
        for attr, processors in previous.items():
            transformers[attr].set_attn_processor(processors)
    measurements = sorted(recorder.cells.values(), key=lambda m: (m.transformer, m.step))
    if not measurements:
        raise ValueError("calibrate(): no attention call reached the processor; is the pipeline's transformer served?")
    groups = fit_groups(measurements, thresholds, group_by=group_by, fit_range=fit_range,
                        disabled_until_timestep=disabled_until_timestep)
    cal = SparsityCalibration(thresholds, measurements, groups, target_sparsity, disabled_until_timestep, tuple(tile))
    logger.info("calibrate: %s", cal.format())
    return cal
