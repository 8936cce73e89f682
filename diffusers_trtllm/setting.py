"""A processor's setting as one JSON file, in a folder or a Hugging Face Hub repo.

``trtllm_attention.json`` holds every argument ``TrtllmAttnProcessor(...)`` was built with (recorded from the
constructor's own signature by :func:`records_arguments`, so a new argument is saved with no change here), the
format's version, and the calibration its layers were given, per denoiser, in ModelOpt's
``sparse_attention_config`` form beside the names of the layers it was made for::

    {"_class_name": "TrtllmAttnProcessor", "format_version": 1, "target_sparsity": 0.5, "quant": "int8", ...,
     "calibration": {"transformer": {"model_class": "FluxTransformer2DModel",
                                     "layers": ["transformer_blocks.0.attn", ...],
                                     "sparse_attention_config": {"config_groups": {...}}}}}

Finding the file (a folder, or a repo id: ``subfolder``, ``revision``, ``cache_dir``, ``local_files_only``,
offline mode, ``token``) is Diffusers' ``ConfigMixin.load_config``; writing and uploading is its
``save_config(push_to_hub=True)`` (``huggingface_hub``'s ``create_repo`` and ``upload_folder``).
What is read is checked here before anything is built: a newer format, a missing or malformed field, or a
foreign file is one line (:class:`SettingFileError`) naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from diffusers.configuration_utils import ConfigMixin
from diffusers.utils import PushToHubMixin

from .config import QuantConfig
from .modelopt_format import parse_sparse_attention_config, read_calibration
from .version import __version__

__all__ = ["SETTING_FILE", "FORMAT_VERSION", "SettingFileError", "Setting", "read_setting", "setting_contents",
           "jsonable", "calibration_source", "is_setting", "constructor_parameters", "check_setting", "build", "records_arguments", "save"]

#: The file ``save_pretrained`` writes and ``from_pretrained`` reads.
SETTING_FILE = "trtllm_attention.json"
#: The file's layout; a reader refuses a newer one (what it cannot know, it would drop).
FORMAT_VERSION = 1
CLASS_NAME = "TrtllmAttnProcessor"
#: Keys the file holds besides the constructor's arguments.
_META_KEYS = ("_class_name", "_diffusers_version", "format_version", "producer", "calibration")
_SECTION_KEYS = ("model_class", "layers", "sparse_attention_config")


class SettingFileError(ValueError):
    """A setting file that cannot be used: its one line names the file and the field."""


class _SettingFile(ConfigMixin, PushToHubMixin):
    """The file as Diffusers handles configurations: ``load_config`` finds it in a folder, the Hub or its cache;
    ``save_config`` writes it and, with ``push_to_hub``, uploads its folder."""

    config_name = SETTING_FILE

    def __init__(self, contents: Mapping[str, Any]) -> None:
        self._contents = contents

    def to_json_string(self) -> str:
        return json.dumps(self._contents, indent=2, sort_keys=True) + "\n"


def records_arguments(init: Callable[..., None]) -> Callable[..., None]:
    """Make a constructor keep every argument it was called with, defaults included and in JSON's types, on the
    instance (``_arguments``): what ``save`` writes. Read from the constructor's own signature, so an argument
    added to it is saved with no change here (Diffusers' ``register_to_config`` does the same for configs)."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        init(self, *args, **kwargs)
        self._arguments = {k: jsonable(v) for k, v in list(bound.arguments.items())[1:]}

    return wrapper


def save(contents: Mapping[str, Any], save_directory: str | os.PathLike, push_to_hub: bool = False,
         **kwargs: Any) -> None:
    """Write ``SETTING_FILE`` into ``save_directory`` and, with ``push_to_hub``, upload the folder: Diffusers'
    ``save_config`` (``repo_id``, ``commit_message``, ``private``, ``token``, ``create_pr``, ``subfolder``)."""
    kwargs.setdefault("commit_message", f"Upload a {CLASS_NAME} setting")
    _SettingFile(contents).save_config(os.fspath(save_directory), push_to_hub=push_to_hub, **kwargs)


@dataclass(frozen=True)
class Setting:
    """A checked setting file: the constructor's arguments, the calibration sections (or None) and where it was read."""

    arguments: Mapping[str, Any]
    calibration: Mapping[str, Mapping[str, Any]] | None
    source: str


def jsonable(value: Any) -> Any:
    """A constructor argument in JSON's types: a ``QuantConfig`` as its fields, a ``torch.dtype`` as its name."""
    if isinstance(value, QuantConfig):
        return dataclasses.asdict(value)
    if isinstance(value, torch.dtype):
        return QuantConfig(dtype_qk=value).dtype_qk
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def setting_contents(arguments: Mapping[str, Any], calibration: Mapping[str, Any] | None) -> dict[str, Any]:
    """The file's content: the constructor's ``arguments`` (``records_arguments``), the format and the calibration."""
    from diffusers import __version__ as diffusers_version

    return {
        "_class_name": CLASS_NAME,
        "_diffusers_version": diffusers_version,
        "format_version": FORMAT_VERSION,
        "producer": {"name": "diffusers-trtllm", "version": __version__},
        **{k: jsonable(v) for k, v in arguments.items() if not k.startswith("_")},
        "calibration": None if calibration is None else jsonable(calibration),
    }


def _where(repo_or_dir: str, subfolder: str | None, revision: str | None) -> str:
    """How messages name the file: its path in a folder, ``repo/subfolder/file@revision`` on the Hub."""
    path = "/".join(p for p in (repo_or_dir.rstrip("/"), subfolder, SETTING_FILE) if p)
    if os.path.isdir(repo_or_dir):
        return os.path.join(repo_or_dir, *(p for p in (subfolder, SETTING_FILE) if p))
    return path + (f"@{revision}" if revision else "")


def _not_read(repo_or_dir: str, where: str, err: OSError, hub: Mapping[str, Any]) -> str:
    """One line for a setting file that Diffusers' ``load_config`` could not find or read."""
    from huggingface_hub import constants
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    cause = err.__context__
    if isinstance(cause, (json.JSONDecodeError, UnicodeDecodeError)):
        return f"{where} is not valid UTF-8 JSON ({cause}): a truncated or damaged file; save or download it again."
    if os.path.isdir(repo_or_dir):
        return f"{where} does not exist: the folder holds no setting; write one with proc.save_pretrained(folder)."
    try:
        validate_repo_id(repo_or_dir)
    except HFValidationError:
        return (f"{repo_or_dir!r} is neither a folder nor a Hub repo id ('user/name'); pass the folder "
                "save_pretrained wrote, or a repo id.")
    if constants.is_offline_mode() or hub.get("local_files_only"):
        why = "HF_HUB_OFFLINE=1" if constants.is_offline_mode() else "local_files_only=True"
        cache = os.fspath(hub.get("cache_dir") or constants.HF_HUB_CACHE)
        return (f"{where} is not in the Hugging Face cache ({cache}) and the Hub is offline "
                f"({why}): download it once with network access, or pass a local folder.")
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(cause or err).__name__
    return f"{where} is missing or cannot be fetched: {first}"


def _fetch(repo_or_dir: str | os.PathLike, **hub: Any) -> tuple[Mapping[str, Any], str]:
    """The JSON of ``SETTING_FILE`` from a folder or the Hub (``hub``: ``load_config``'s keywords)."""
    repo_or_dir = os.fspath(repo_or_dir)
    where = _where(repo_or_dir, hub.get("subfolder"), hub.get("revision"))
    try:
        with warnings.catch_warnings():  # Diffusers 0.42 passes huggingface_hub an argument it has retired
            warnings.filterwarnings("ignore", message="The `local_dir_use_symlinks` argument is deprecated")
            contents = _SettingFile.load_config(repo_or_dir, **hub)
    except OSError as err:
        raise SettingFileError(_not_read(repo_or_dir, where, err, hub)) from None
    except RecursionError:
        raise SettingFileError(f"{where} is nested too deeply to read as JSON: a setting is a few levels of objects.") from None
    return contents, where


def constructor_parameters(cls: type) -> list[str]:
    """The names ``cls(...)`` takes: what a setting file holds, read from the constructor's own signature."""
    return [p.name for p in inspect.signature(cls.__init__).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)][1:]


def _field_error(where: str, field: str, what: str) -> SettingFileError:
    return SettingFileError(f"{where}: field {field!r} {what}")


def _check_sections(where: str, calibration: Any) -> Mapping[str, Mapping[str, Any]] | None:
    if calibration is None:
        return None
    if not isinstance(calibration, Mapping) or not calibration:
        raise _field_error(where, "calibration", "must be null or an object with one section per denoiser "
                                                 "({\"transformer\": {...}}); got " + f"{calibration!r:.60}.")
    for attr, section in calibration.items():
        field = f"calibration.{attr}"
        if not isinstance(section, Mapping):
            raise _field_error(where, field, f"must be an object with {', '.join(_SECTION_KEYS)}; got {section!r:.60}.")
        for key in _SECTION_KEYS:
            if key not in section:
                raise _field_error(where, f"{field}.{key}", "is missing.")
        unknown = sorted(set(section) - set(_SECTION_KEYS))
        if unknown:
            raise _field_error(where, f"{field}.{unknown[0]}", f"is not a field of format {FORMAT_VERSION} "
                                                                f"(it holds {', '.join(_SECTION_KEYS)}).")
        if not isinstance(section["model_class"], str):
            raise _field_error(where, f"{field}.model_class", f"must be a class name; got {section['model_class']!r:.60}.")
        layers = section["layers"]
        if not isinstance(layers, list) or not layers or not all(isinstance(n, str) for n in layers):
            raise _field_error(where, f"{field}.layers", f"must be a non-empty list of layer names; got {layers!r:.60}.")
        if section["sparse_attention_config"] is not None:
            try:
                parse_sparse_attention_config(section["sparse_attention_config"])
            except ValueError as err:
                raise _field_error(where, f"{field}.sparse_attention_config", f"is malformed: {err}") from None
    return calibration


def check_setting(contents: Any, where: str, cls: type) -> Setting:
    """``contents`` of a setting file checked field by field; the arguments are those of ``cls``'s constructor."""
    if not isinstance(contents, Mapping):
        raise SettingFileError(f"{where} holds {type(contents).__name__}, not a setting object.")
    name = contents.get("_class_name")
    if name is None:
        raise _field_error(where, "_class_name", f"is missing: not a {CLASS_NAME} setting (save_pretrained writes one).")
    if name != CLASS_NAME:
        raise _field_error(where, "_class_name", f"is {name!r}: the file belongs to another class, not a {CLASS_NAME} setting.")
    version = contents.get("format_version")
    if version is None:
        raise _field_error(where, "format_version", "is missing.")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise _field_error(where, "format_version", f"must be a positive integer; got {version!r:.40}.")
    producer = contents.get("producer")
    written_by = producer.get("version") if isinstance(producer, Mapping) else None
    if version > FORMAT_VERSION:
        raise _field_error(where, "format_version", f"is {version}, written by a newer diffusers-trtllm "
                           f"({written_by or 'unknown version'}); this one ({__version__}) reads format "
                           f"{FORMAT_VERSION}: upgrade diffusers-trtllm.")
    parameters = set(constructor_parameters(cls))
    unknown = sorted(set(map(str, contents)) - parameters - set(_META_KEYS))
    if unknown:
        raise _field_error(where, unknown[0], f"is not an argument of {CLASS_NAME} in diffusers-trtllm {__version__} "
                           f"(the file was written by {written_by or 'an unknown version'}): upgrade diffusers-trtllm.")
    calibration = _check_sections(where, contents.get("calibration"))
    arguments = {k: v for k, v in contents.items() if k in parameters}
    return Setting(arguments, calibration, where)


def build(factory: Callable[..., Any], setting: Setting, overrides: Mapping[str, Any]) -> Any:
    """``factory(**arguments)``; a refused argument is one line naming the file and that field."""
    arguments = {**setting.arguments, **overrides}
    try:
        return factory(**arguments)
    except ValueError as err:  # also ControlTypeError
        field = next((k for k, v in setting.arguments.items() if k not in overrides and _refuses(factory, k, v)), None)
        line = str(err).strip().splitlines()[0]
        raise (_field_error(setting.source, field, f"is refused: {line}") if field is not None
               else SettingFileError(f"{setting.source}: {line}")) from None


def _refuses(factory: Callable[..., Any], key: str, value: Any) -> bool:
    try:
        factory(**{key: value})
    except ValueError:
        return True
    return False


def read_setting(repo_or_dir: str | os.PathLike, cls: type, **hub: Any) -> Setting:
    """The checked setting of a folder or Hub repo (``hub``: ``subfolder``, ``revision``, ``cache_dir``, ...)."""
    hub = {k: v for k, v in hub.items() if v is not None}
    contents, where = _fetch(repo_or_dir, **hub)
    return check_setting(contents, where, cls)


def is_setting(contents: Mapping[str, Any]) -> bool:
    """Whether a JSON object is a setting file (rather than a ModelOpt calibration or a checkpoint's config)."""
    return contents.get("_class_name") == CLASS_NAME or "format_version" in contents


def calibration_source(source: Any, cls: type, **hub: Any) -> tuple[Mapping[str, Any], str]:
    """What ``load_calibration`` reads and how its messages name it: ``calibrate()``'s result, a dict, a JSON file
    (ModelOpt's form or a setting file), a model folder's ``config.json``, a folder holding a setting, or a Hub
    repo id of one."""
    if not isinstance(source, (str, os.PathLike)):
        return read_calibration(source), "the calibration given"
    path = os.fspath(source)
    if os.path.exists(path) or not _looks_like_repo_id(path):
        subfolder = hub.get("subfolder")
        folder = os.path.join(path, subfolder) if subfolder and os.path.isdir(path) else path
        if os.path.isdir(folder) and os.path.isfile(os.path.join(folder, SETTING_FILE)):
            setting = read_setting(folder, cls)
        else:
            if os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, "config.json")):
                raise SettingFileError(f"{folder} holds neither {SETTING_FILE} (save_pretrained's) nor config.json (a "
                                       "checkpoint's); pass the folder of either, a JSON file or a Hub repo id.")
            given = read_calibration(folder)
            if not is_setting(given):
                return given, folder
            setting = check_setting(given, folder, cls)
    else:
        setting = read_setting(path, cls, **hub)
    build(cls, setting, {})  # the arguments are read too: a file that from_pretrained refuses is refused here
    if setting.calibration is None:
        raise _field_error(setting.source, "calibration", "is null: the setting holds no calibration (save it after "
                                                          "load_calibration, or pass skip_softmax_threshold).")
    return setting.calibration, setting.source


def _looks_like_repo_id(text: str) -> bool:
    """``user/name`` as the Hub spells a repo (a path that does not exist and is not a JSON file name)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if text.count("/") != 1 or text.endswith(".json"):
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True
