"""Skip-softmax calibration from checkpoints (NVIDIA ModelOpt's ``sparse_attention_config``).

A transformer's ``config.json`` may carry::

    "sparse_attention_config": {"config_groups": {"group_0": {
      "algorithm": "skip_softmax",
      "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)",
                                 "coefficients": {"a": 2822.62, "b": 4.388}},
      "target_sparsity": 0.7, "disabled_until_timestep": 0.93,
      "ignore": ["blocks.0.attn1", "blocks.39.*"]}}}

``coefficients`` may be spelled ``prefill`` (ModelOpt's and TensorRT-LLM's name; ``save_calibration``
writes both) and ``target_sparsity`` may be ``{"prefill": value}``; the formula may be
``exp(log_a + b * target_sparsity)`` (then the coefficients are ``log_a`` and ``b``).
``ignore`` holds fnmatch patterns of module names (relative to the transformer) that
stay dense; an optional ``targets`` list limits a group to matching modules (the
first matching group wins). Wan 2.2's two experts each carry their own curve.

The checkpoint's ``target_sparsity`` and ``disabled_until_timestep`` apply when the
processor was built without a skip control; a user's ``target_sparsity`` uses the
checkpoint's curve; a ``skip_softmax_threshold`` needs no curve.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .._logging import warn_once
from ..config import ControlTypeError, check_curve, unknown_keys_message
from ..serving.layer import Calibration, LayerState, layer_of
from ..serving.modules import denoisers, is_denoiser_name, uncompiled
from ..version import __version__

__all__ = [
    "CalibrationGroup", "parse_sparse_attention_config", "read_calibration", "load_calibration", "FORMULAS",
    "sparse_attention_config", "save_calibration", "check_calibration",
]

#: Supported curve formulas (whitespace-insensitive) and the coefficient naming the scale.
FORMULAS = {
    "a*exp(b*target_sparsity)": "a",
    "exp(log_a+b*target_sparsity)": "log_a",
}
#: Keys this loader reads; others are reported (with the closest known key) and ignored.
_GROUP_KEYS = ("algorithm", "threshold_scale_factor", "target_sparsity", "disabled_until_timestep", "ignore", "targets")
_CURVE_KEYS = ("formula", "coefficients", "prefill")
_CONFIG_KEYS = ("config_groups", "producer")  # producer: who wrote it (ModelOpt and save_calibration say)


def _warn_unknown(where: str, found: Mapping[str, Any], known: tuple[str, ...]) -> None:
    unknown = set(map(str, found)) - set(known)
    if unknown:
        warn_once(("calibration-keys", where, frozenset(unknown)), "%s (ignored)",
                  unknown_keys_message(where, unknown, known))


@dataclass(frozen=True)
class CalibrationGroup:
    """One ``config_groups`` entry: a curve, checkpoint defaults and the modules it covers."""

    name: str
    a: float
    b: float
    target_sparsity: float | None = None
    disabled_until_timestep: float | None = None
    ignore: tuple[str, ...] = ()
    targets: tuple[str, ...] = ("*",)

    def covers(self, module_name: str) -> bool:
        return any(fnmatch.fnmatchcase(module_name, p) for p in self.targets)

    def ignores(self, module_name: str) -> bool:
        return any(fnmatch.fnmatchcase(module_name, p) for p in self.ignore)


def _number(group: str, key: str, value: Any, lo: float | None = None, hi: float | None = None) -> float:
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer beyond float range
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"sparse_attention_config group {group!r}: {key} must be a finite number; got {value!r:.40}.")
    if (lo is not None and number < lo) or (hi is not None and number > hi):
        allowed = f"in [{lo}, {hi}]" if lo is not None and hi is not None else f">= {lo}" if lo is not None else f"<= {hi}"
        raise ValueError(f"sparse_attention_config group {group!r}: {key} must be {allowed}; got {value!r}.")
    return number


def _patterns(group: str, key: str, value: Any, default: tuple[str, ...]) -> tuple[str, ...]:
    if value is None:
        return default
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
        raise ValueError(f"sparse_attention_config group {group!r}: {key} must be a list of fnmatch patterns; got {value!r}.")
    return tuple(value)


def _parse_group(name: str, group: Any) -> CalibrationGroup:
    if not isinstance(group, Mapping):
        raise ValueError(f"sparse_attention_config group {name!r} must be an object; got {type(group).__name__}.")
    _warn_unknown(f"sparse_attention_config group {name!r}", group, _GROUP_KEYS)
    algorithm = group.get("algorithm", "skip_softmax")
    if algorithm != "skip_softmax":
        raise ValueError(
            f"sparse_attention_config group {name!r}: algorithm {algorithm!r} is not supported; "
            "only 'skip_softmax' calibrations can drive this processor."
        )
    tsf = group.get("threshold_scale_factor")
    if not isinstance(tsf, Mapping):
        raise ValueError(
            f"sparse_attention_config group {name!r} has no threshold_scale_factor object "
            '({"formula": ..., "coefficients": {...}}); add one or drop the group.'
        )
    _warn_unknown(f"sparse_attention_config group {name!r} threshold_scale_factor", tsf, _CURVE_KEYS)
    formula = str(tsf.get("formula", "")).replace(" ", "")
    if formula not in FORMULAS:
        raise ValueError(
            f"sparse_attention_config group {name!r}: formula {tsf.get('formula')!r} is not supported; "
            "use 'a * exp(b * target_sparsity)' or 'exp(log_a + b * target_sparsity)'."
        )
    coeffs = tsf.get("coefficients", tsf.get("prefill"))
    scale_key = FORMULAS[formula]
    if not isinstance(coeffs, Mapping) or scale_key not in coeffs or "b" not in coeffs:
        raise ValueError(
            f"sparse_attention_config group {name!r}: threshold_scale_factor needs 'coefficients' (or 'prefill') "
            f"with {scale_key!r} and 'b' for formula {tsf.get('formula')!r}; got {coeffs!r}."
        )
    b = _number(name, "b", coeffs["b"])
    if scale_key == "a":
        a = _number(name, "a", coeffs["a"])
    else:
        log_a = _number(name, "log_a", coeffs["log_a"], hi=700.0)  # exp(700) ~ 1e304: beyond it overflows
        a = math.exp(log_a)
    check_curve(f"sparse_attention_config group {name!r}", a, b)
    ts, dut = group.get("target_sparsity"), group.get("disabled_until_timestep")
    if isinstance(ts, Mapping):  # ModelOpt's per-phase spelling; a diffusion transformer only has prefill
        ts = ts.get("prefill")
    return CalibrationGroup(
        name=name,
        a=a,
        b=b,
        target_sparsity=None if ts is None else _number(name, "target_sparsity", ts, 0.0, 1.0),
        disabled_until_timestep=None if dut is None else _number(name, "disabled_until_timestep", dut, 0.0, 1.0),
        ignore=_patterns(name, "ignore", group.get("ignore"), ()),
        targets=_patterns(name, "targets", group.get("targets"), ("*",)),
    )


def parse_sparse_attention_config(config: Mapping[str, Any]) -> list[CalibrationGroup]:
    """Validate a ``sparse_attention_config`` object (or a dict holding one) into groups."""
    if isinstance(config, Mapping) and "sparse_attention_config" in config:
        config = config["sparse_attention_config"]
    if isinstance(config, Mapping):
        _warn_unknown("sparse_attention_config", config, _CONFIG_KEYS)
    groups = config.get("config_groups") if isinstance(config, Mapping) else None
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(
            'sparse_attention_config must hold a non-empty "config_groups" object of groups '
            f"({{\"group_0\": {{\"algorithm\": \"skip_softmax\", ...}}}}); got {config!r:.200}."
        )
    return [_parse_group(str(name), group) for name, group in groups.items()]


def read_calibration(source: Any) -> Mapping[str, Any]:
    """A calibration object from a dict, ``calibrate()``'s result, a JSON file, or a model directory's
    ``config.json``.

    Every problem with the file (missing, unreadable, not UTF-8 JSON, not an object) raises a
    ``ValueError`` naming its path.
    """
    if callable(getattr(source, "config", None)):  # calibrate()'s result, which save_calibration takes too
        source = source.config()
    if isinstance(source, Mapping):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise ControlTypeError(
            "calibration must be a path to a JSON file or model directory, a dict, calibrate()'s result, or None; "
            f"got {source!r:.80} ({type(source).__name__})."
        )
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"calibration file {path!r} does not exist; pass a JSON file, a model directory or a dict.")
    loaded = _read_json(path)
    if not isinstance(loaded, Mapping):
        raise ValueError(
            f"calibration file {path!r} holds {json.dumps(loaded)[:40]} ({type(loaded).__name__}); expected a JSON "
            'object with "sparse_attention_config" or "config_groups".'
        )
    return loaded


def _read_json(path: str) -> Any:
    """A JSON file's content; a ``ValueError`` naming the file for anything that stops reading it (including
    nesting too deep for the parser and integers beyond Python's digit limit)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except RecursionError:
        raise ValueError(f"calibration file {path!r} is nested too deeply to read as JSON; a calibration is a few "
                         "levels of objects.") from None
    except (OSError, ValueError) as err:  # ValueError: JSON syntax, UTF-8, Python's integer digit limit
        raise ValueError(f"calibration file {path!r} could not be read as UTF-8 JSON: {err}") from None


def check_calibration(source: str | os.PathLike | Mapping[str, Any]) -> None:
    """Read and validate a calibration (file, model directory or dict) before any model is built; a
    ``ValueError`` says what is wrong. Holds one ``sparse_attention_config`` or one per transformer."""
    given = read_calibration(source)
    for config in given.values() if _per_denoiser(given) else [given]:
        parse_sparse_attention_config(config)


def _own_config(transformer: torch.nn.Module) -> Mapping[str, Any] | None:
    """The transformer's ``sparse_attention_config``: from its config, else its directory's config.json."""
    config = getattr(transformer, "config", None) or {}
    found = config.get("sparse_attention_config") if hasattr(config, "get") else None
    if found is not None:
        return {"sparse_attention_config": found}
    directory = config.get("_name_or_path") if hasattr(config, "get") else None
    if directory and os.path.isfile(os.path.join(str(directory), "config.json")):
        on_disk = read_calibration(str(directory))
        if "sparse_attention_config" in on_disk:
            return on_disk
    return None


def _transformers(target: Any) -> dict[str, torch.nn.Module]:
    """A module as ``"transformer"``, or a pipeline's denoisers by component name (``serving.modules``)."""
    return {"transformer": target} if isinstance(target, torch.nn.Module) else denoisers(target, "calibrate")


def _per_denoiser(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` holds one section per denoiser (``{"transformer": ..., "transformer_2": ...}``)."""
    return any(is_denoiser_name(str(k)) for k in config)


def _layers(transformer: torch.nn.Module) -> list[tuple[str, LayerState]]:
    found = []
    for name, module in uncompiled(transformer).named_modules():
        state = layer_of(module)
        if state is not None:
            state.name = name
            found.append((name, state))
    return found


def load_calibration(target: Any, path_or_dict: Any = None) -> dict[str, dict[str, int]]:
    """Apply skip-softmax calibrations to the layers a ``TrtllmAttnProcessor`` serves.

    ``target``: a pipeline (each of its denoisers, ``serving.modules``: ``transformer`` and
    ``transformer_2``, ``unet``, ...) or one transformer, with the processor already installed.
    ``path_or_dict``: None reads each denoiser's own config; ``calibrate()``'s result, or a dict / JSON
    file / model directory holding either one ``sparse_attention_config`` for all or one per component name
    (``{"transformer": ..., "transformer_2": ...}``).
    Returns, per transformer, how many layers got a curve and how many stay dense.
    """
    transformers = _transformers(target)
    given = read_calibration(path_or_dict) if path_or_dict is not None else None
    summary: dict[str, dict[str, int]] = {}
    missing: list[str] = []
    for attr, transformer in transformers.items():
        layers = _layers(transformer)
        if not layers:
            raise ValueError(
                f"{attr} ({type(transformer).__name__}) has no layer served by TrtllmAttnProcessor; "
                "install it first: transformer.set_attn_processor(TrtllmAttnProcessor(...))."
            )
        if given is None:
            config = _own_config(transformer)
        elif _per_denoiser(given):
            config = given.get(attr)
        else:
            config = given
        groups = parse_sparse_attention_config(config) if config is not None else []
        counts = {"calibrated": 0, "ignored": 0, "uncovered": 0}
        for name, state in layers:
            group = next((g for g in groups if g.covers(name)), None)
            state.ignored = group is not None and group.ignores(name)
            state.calibration = None
            if group is None:
                counts["uncovered"] += 1
            elif state.ignored:
                counts["ignored"] += 1
            else:
                state.calibration = Calibration(group.a, group.b, group.target_sparsity, group.disabled_until_timestep,
                                                source=f"{attr}:{group.name}")
                counts["calibrated"] += 1
            state.refresh()
            if state.needs_calibration:
                missing.append(f"{attr}.{name}")
        summary[attr] = counts
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(
            f"target_sparsity is set but no calibration curve covers {shown}. Load a sparse_attention_config "
            "that covers these modules (its 'targets'), list them in its 'ignore' to keep them dense, or use "
            "skip_softmax_threshold instead of target_sparsity."
        )
    return summary


def sparse_attention_config(
    groups: list[tuple[str, float, float, tuple[str, ...] | None, tuple[float, float] | None]],
    *,
    target_sparsity: float | None = None,
    disabled_until_timestep: float = 0.0,
    ignore: tuple[str, ...] = (),
) -> dict[str, Any]:
    """ModelOpt's ``sparse_attention_config`` from fitted curves ``(name, a, b, targets, observed range)``.

    ``targets`` None covers every module. The coefficients go under both ``coefficients`` and
    ``prefill`` so that every reader finds them; the result parses back with
    ``parse_sparse_attention_config``.
    """
    out: dict[str, Any] = {}
    for name, a, b, targets, observed in groups:
        prefill: dict[str, Any] = {"a": a, "b": b}
        if observed is not None:
            prefill.update(min_observed_sparsity=observed[0], max_observed_sparsity=observed[1])
        group: dict[str, Any] = {
            "algorithm": "skip_softmax",
            "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "coefficients": {"a": a, "b": b},
                                       "prefill": prefill},
        }
        if target_sparsity is not None:
            group["target_sparsity"] = target_sparsity
        if disabled_until_timestep:
            group["disabled_until_timestep"] = disabled_until_timestep
        if targets is not None:
            group["targets"] = list(targets)
        if ignore:
            group["ignore"] = list(ignore)
        _parse_group(name, group)  # what we write, we can read
        out[name] = group
    return {"config_groups": out, "producer": {"name": "diffusers-trtllm", "version": __version__}}


def save_calibration(calibration: Any, path: str | os.PathLike) -> str:
    """Write a calibration (``calibrate``'s result, or a config dict) where ``load_calibration`` reads it.

    ``path`` a file: JSON, ``{"sparse_attention_config": ...}`` for one transformer or
    ``{"transformer": ..., "transformer_2": ...}`` for two (Wan 2.2). ``path`` a checkpoint
    folder (``save_pretrained``'s output): merged into each transformer's ``config.json``
    (``<folder>/transformer/config.json``, or ``<folder>/config.json`` for a transformer folder),
    so ``load_calibration(pipe)`` finds it with no argument. Returns the path written.
    """
    config = calibration.config() if hasattr(calibration, "config") else calibration
    if not isinstance(config, Mapping):
        raise ValueError(f"save_calibration needs calibrate()'s result or a config dict; got {type(calibration).__name__}.")
    path = os.fspath(path)
    if os.path.isdir(path):
        per = config if _per_denoiser(config) else {"transformer": config}
        pipeline = os.path.isfile(os.path.join(path, "model_index.json"))
        for attr, section in per.items():
            target = os.path.join(path, attr, "config.json") if pipeline else os.path.join(path, "config.json")
            if not os.path.isfile(target):
                raise ValueError(f"{target} does not exist; pass a checkpoint folder saved with save_pretrained, "
                                 "or a .json file path.")
            on_disk = _read_json(target)
            section = read_calibration(section)
            on_disk["sparse_attention_config"] = section.get("sparse_attention_config", section)
            parse_sparse_attention_config(on_disk)  # what we write, we can read
            _write_json(on_disk, target)
        return path
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _write_json(config, path)
    return path


def _write_json(config: Mapping[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
