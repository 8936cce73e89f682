"""Applying a skip-softmax calibration (ModelOpt's ``sparse_attention_config``) to the layers a processor serves.

:func:`apply_calibration` works in two passes: every layer's curve (or ``ignore``) is worked out and every
check made first, so a calibration that does not fit leaves every layer as it was; then the curves are set.
The processors serving the layers keep what they were given (:class:`CalibrationRecord`), which
``TrtllmAttnProcessor.save_pretrained`` writes and ``install`` applies again to a pipeline the processor is
installed on. A record names the layers it was made for, so a calibration of another model is refused by
name (:func:`check_layers`). The format itself is :mod:`diffusers_trtllm.modelopt_format`'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from ..modelopt_format import parse_sparse_attention_config, per_denoiser, read_calibration
from ..setting import SettingFileError
from .layer import Calibration, LayerState, layer_of
from .modules import attention_modules, denoisers, uncompiled

__all__ = ["CalibrationRecord", "apply_calibration", "check_layers", "denoiser_name", "model_layers", "section_for",
           "SECTION_KEYS"]

#: The keys of one denoiser's section of a saved calibration.
SECTION_KEYS = ("model_class", "layers", "sparse_attention_config")


@dataclass(frozen=True)
class CalibrationRecord:
    """What a processor's layers were calibrated with, per denoiser: ``{name: {"model_class", "layers",
    "sparse_attention_config"}}`` (the config None where no curve was given), and where it was read."""

    sections: Mapping[str, Mapping[str, Any]]
    source: str


def denoiser_name(attr: str) -> str:
    """A denoiser's section name: a lone module (``install(transformer, proc)``) is ``"transformer"``."""
    return attr or "transformer"


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


def _layers(transformer: torch.nn.Module) -> list[tuple[str, LayerState]]:
    found = []
    for name, module in uncompiled(transformer).named_modules():
        state = layer_of(module)
        if state is not None:
            state.name = name
            found.append((name, state))
    return found


def _shown(names: Iterable[str], limit: int = 3) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_layers(sections: Mapping[str, Mapping[str, Any]], found: Mapping[str, tuple[str, list[str]]],
                 source: str) -> None:
    """Refuse (``SettingFileError``), in one line naming ``source`` and the field, a calibration made for other layers.

    ``found``: per denoiser, its class name and the names of its attention layers.
    """
    if set(sections) != set(found):
        raise SettingFileError(f"{source}: field 'calibration' has sections for {_shown(sections)}, and the pipeline's "
                         f"denoisers are {_shown(found)}; load the setting made for this pipeline.")
    for attr, section in sections.items():
        cls, names = found[attr]
        missing, extra = set(names) - set(section["layers"]), set(section["layers"]) - set(names)
        if missing or extra:
            differ = "; ".join(part for part in (f"not in the file: {_shown(missing)}" if missing else "",
                                                  f"only in the file: {_shown(extra)}" if extra else "") if part)
            raise SettingFileError(
                f"{source}: field 'calibration.{attr}.layers' names the {len(section['layers'])} attention layers "
                f"of a {section['model_class']}, and {attr} here is a {cls} whose layers differ ({differ}): the "
                "setting was made for another model; load the one made for this one.")


def _config_for(attr: str, transformer: torch.nn.Module, given: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    if given is None:
        return _own_config(transformer)
    if per_denoiser(given):
        return given.get(attr)
    return given


def model_layers(root: torch.nn.Module) -> tuple[str, list[str]]:
    """``root``'s class name and the names of its attention modules: what a saved calibration's section names."""
    return type(uncompiled(root)).__name__, [name for name, _ in attention_modules(root)]


def section_for(record: CalibrationRecord, transformer: torch.nn.Module) -> dict[str, Mapping[str, Any]]:
    """The section of ``record`` made for ``transformer``'s layers, as ``{"transformer": section}``: what
    ``transformer.set_attn_processor(proc)`` gives the layers of a processor that carries a calibration
    (``from_pretrained``). Refused in one line where no section fits, or where several do (Wan 2.2's two experts
    have layers of the same names: ``install(pipe, proc)`` gives each its own)."""
    found = model_layers(transformer)
    if len(record.sections) == 1:
        (section,) = record.sections.values()
        check_layers({"transformer": section}, {"transformer": found}, record.source)
        return {"transformer": section}
    fitting = [attr for attr, section in record.sections.items()
               if section["model_class"] == found[0] and set(section["layers"]) == set(found[1])]
    if len(fitting) == 1:
        return {"transformer": record.sections[fitting[0]]}
    if fitting:
        raise ValueError(f"{record.source}: its calibration has sections for {_shown(fitting)}, each made for this "
                         f"{found[0]}'s layers; install(pipe, proc) gives each denoiser of the pipeline its own.")
    raise SettingFileError(f"{record.source}: field 'calibration' has sections for {_shown(record.sections)}, none made "
                           f"for this {found[0]}'s {len(found[1])} attention layers; load the setting made for this model.")


def apply_calibration(target: Any, given: Mapping[str, Any] | None, source: str) -> dict[str, dict[str, int]]:
    """Give every served layer of ``target``'s denoisers its curve from ``given`` (None: each denoiser's own
    config), or ``ignore``; nothing changes unless all of it fits. Returns the counts per denoiser."""
    transformers = _transformers(target)
    planned: list[tuple[LayerState, bool, Calibration | None]] = []
    sections: dict[str, dict[str, Any]] = {}
    summary: dict[str, dict[str, int]] = {}
    missing: list[str] = []
    found = {}
    for attr, transformer in transformers.items():
        layers = _layers(transformer)
        if not layers:
            raise ValueError(
                f"{attr} ({type(transformer).__name__}) has no layer served by TrtllmAttnProcessor; "
                "install it first: transformer.set_attn_processor(TrtllmAttnProcessor(...))."
            )
        found[attr] = (type(uncompiled(transformer)).__name__, [name for name, _ in layers])
    if given is not None and per_denoiser(given) and all(isinstance(s, Mapping) and "layers" in s for s in given.values()):
        check_layers(given, found, source)
    for attr, transformer in transformers.items():
        config = _config_for(attr, transformer, given)
        groups = parse_sparse_attention_config(config) if config is not None else []
        counts = {"calibrated": 0, "ignored": 0, "uncovered": 0}
        for name, state in _layers(transformer):
            group = next((g for g in groups if g.covers(name)), None)
            ignored = group is not None and group.ignores(name)
            calibration = None
            if group is None:
                counts["uncovered"] += 1
            elif ignored:
                counts["ignored"] += 1
            else:
                calibration = Calibration(group.a, group.b, group.target_sparsity, group.disabled_until_timestep,
                                          source=f"{attr}:{group.name}")
                counts["calibrated"] += 1
            settings = state.processor._role_settings[state.role]
            if settings.mode == "trtllm" and settings.skip.target_sparsity is not None and calibration is None and not ignored:
                missing.append(f"{attr}.{name}")
            planned.append((state, ignored, calibration))
        summary[attr] = counts
        inner = None if config is None else config.get("sparse_attention_config", config)
        sections[attr] = {"model_class": found[attr][0], "layers": found[attr][1], "sparse_attention_config": inner}
    if missing:
        raise ValueError(
            f"target_sparsity is set but no calibration curve covers {_shown(missing, 5)}. Load a "
            "sparse_attention_config that covers these modules (its 'targets'), list them in its 'ignore' to keep "
            "them dense, or use skip_softmax_threshold instead of target_sparsity."
        )
    record = CalibrationRecord(sections, source)
    for state, ignored, calibration in planned:
        state.ignored, state.calibration = ignored, calibration
        state.processor._calibration = record
        state.refresh()
    return summary
