"""NVIDIA ModelOpt's ``sparse_attention_config``: reading, checking and writing it (no model needed).

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

This module reads and writes the format; :mod:`diffusers_trtllm.serving.calibrated` applies it to the
layers a processor serves, and :mod:`diffusers_trtllm.calibration.checkpoint` is the user's entry point.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from ._logging import warn_once
from .config import ControlTypeError, check_curve, is_denoiser_name, unknown_keys_message
from .version import __version__

__all__ = [
    "CalibrationGroup", "parse_sparse_attention_config", "read_calibration", "FORMULAS", "sparse_attention_config",
    "check_calibration", "per_denoiser", "read_json", "write_json",
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
    loaded = read_json(path)
    if not isinstance(loaded, Mapping):
        raise ValueError(
            f"calibration file {path!r} holds {json.dumps(loaded)[:40]} ({type(loaded).__name__}); expected a JSON "
            'object with "sparse_attention_config" or "config_groups".'
        )
    return loaded


def read_json(path: str) -> Any:
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


def per_denoiser(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` holds one section per denoiser (``{"transformer": ..., "transformer_2": ...}``)."""
    return any(is_denoiser_name(str(k)) for k in config)


def check_calibration(source: str | os.PathLike | Mapping[str, Any]) -> None:
    """Read and validate a calibration (file, model directory or dict) before any model is built; a
    ``ValueError`` says what is wrong. Holds one ``sparse_attention_config`` or one per transformer."""
    given = read_calibration(source)
    for config in given.values() if per_denoiser(given) else [given]:
        parse_sparse_attention_config(config)


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


def write_json(config: Mapping[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
