"""Skip-softmax calibration from checkpoints, saved settings and the Hub: the user's entry points.

A transformer's ``config.json`` may carry NVIDIA ModelOpt's ``sparse_attention_config`` (the format:
:mod:`diffusers_trtllm.modelopt_format`); a setting saved with ``TrtllmAttnProcessor.save_pretrained``
carries one per denoiser beside the processor's arguments (:mod:`diffusers_trtllm.setting`), in a folder
or a Hub repo. :func:`load_calibration` reads any of them and applies it
(:mod:`diffusers_trtllm.serving.calibrated`); :func:`save_calibration` writes one into a checkpoint.

The checkpoint's ``target_sparsity`` and ``disabled_until_timestep`` apply when the
processor was built without a skip control; a user's ``target_sparsity`` uses the
checkpoint's curve; a ``skip_softmax_threshold`` needs no curve.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from ..modelopt_format import (FORMULAS, CalibrationGroup, check_calibration, parse_sparse_attention_config,
                               per_denoiser, read_calibration, read_json, sparse_attention_config, write_json)
from ..serving.calibrated import apply_calibration
from ..serving.processor import TrtllmAttnProcessor
from ..setting import calibration_source

__all__ = [
    "CalibrationGroup", "parse_sparse_attention_config", "read_calibration", "load_calibration", "FORMULAS",
    "sparse_attention_config", "save_calibration", "check_calibration",
]


def load_calibration(target: Any, path_or_dict: Any = None, *, subfolder: str | None = None,
                     revision: str | None = None, cache_dir: str | os.PathLike | None = None,
                     local_files_only: bool | None = None, token: str | bool | None = None) -> dict[str, dict[str, int]]:
    """Apply skip-softmax calibrations to the layers a ``TrtllmAttnProcessor`` serves.

    ``target``: a pipeline (each of its denoisers, ``serving.modules``: ``transformer`` and
    ``transformer_2``, ``unet``, ...) or one transformer, with the processor already installed.
    ``path_or_dict``: None reads each denoiser's own config; ``calibrate()``'s result, or a dict / JSON
    file / model directory holding either one ``sparse_attention_config`` for all or one per component name
    (``{"transformer": ..., "transformer_2": ...}``); or a setting saved with ``proc.save_pretrained`` (its
    folder, or a Hub repo id: ``subfolder``, ``revision``, ``cache_dir``, ``local_files_only`` and ``token`` as in
    Diffusers' ``from_pretrained``), whose layers must be this pipeline's. Nothing changes unless all of it fits.
    Returns, per transformer, how many layers got a curve and how many stay dense.
    """
    if path_or_dict is None:
        return apply_calibration(target, None, "each denoiser's own config")
    given, source = calibration_source(path_or_dict, TrtllmAttnProcessor, subfolder=subfolder,
                                       revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                                       token=token)
    return apply_calibration(target, given, source)


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
        per = config if per_denoiser(config) else {"transformer": config}
        pipeline = os.path.isfile(os.path.join(path, "model_index.json"))
        for attr, section in per.items():
            target = os.path.join(path, attr, "config.json") if pipeline else os.path.join(path, "config.json")
            if not os.path.isfile(target):
                raise ValueError(f"{target} does not exist; pass a checkpoint folder saved with save_pretrained, "
                                 "or a .json file path.")
            on_disk = read_json(target)
            section = read_calibration(section)
            on_disk["sparse_attention_config"] = section.get("sparse_attention_config", section)
            parse_sparse_attention_config(on_disk)  # what we write, we can read
            write_json(on_disk, target)
        return path
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json(config, path)
    return path
