"""``TrtllmAttnProcessor``: the settings one shared attention processor applies, per attention role.

Install it with :func:`diffusers_trtllm.install` (any pipeline or module), or like any
processor where the model has ``set_attn_processor``::

    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.05, disabled_until_timestep=0.9,
                               quant={"dtype_qk": "int8"}, roles={"cross": "dense"})
    diffusers_trtllm.install(pipe, proc)        # or pipe.transformer.set_attn_processor(proc)

Every attention module keeps its family's stock processor (projections, QK norm, RoPE
stay Diffusers'); only the core attention call is routed to our kernels
(:mod:`diffusers_trtllm.serving.intercept`), and Wan's rotary embedding is applied by one launch of ours
with the same values (:mod:`diffusers_trtllm.serving.rotary`). Per-layer state lives on the module it serves
(:mod:`diffusers_trtllm.serving.layer`); statistics in :mod:`diffusers_trtllm.stats`. This
module holds the settings, resolves them per role and layer, and gives each layer what it
needs through the package-internal names ``_settings_for``, ``_call_observer``, ``_fallback_timestep``,
``_step_callback_attached``, ``_layouts``, ``_adopt`` / ``_release`` and ``_stock_processor``: the
user's surface is the constructor, ``set_timestep``, ``layers`` and the tables.
See docs/design.md.
"""

from __future__ import annotations

import copy
import inspect
import numbers
import os
import weakref
from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch
from diffusers.utils import PushToHubMixin

from .. import setting as _setting
from .. import stats
from ..attention import check_route_choice
from ..config import CPU_ROUTES, ControlTypeError, QuantConfig, SkipSoftmaxConfig, check_mapping, unknown_keys_message
from ..layout import LayoutCache
from ..routing.policy import POLICIES
from ..stats import StepRecord
from . import intercept as _intercept
from .calibrated import CalibrationRecord
from .ip_adapter import serve_in_place, stop_serving_in_place
from .layer import Calibration, LayerState, attach_layer, layer_of
from .roles import ROLES
from .setters import hold_setters, layer_bound, restored_stock

__all__ = ["TrtllmAttnProcessor", "LayerState", "StepRecord", "Calibration", "Settings", "ROLES"]

#: Keys a per-role override may set.
_ROLE_KEYS = ("skip_softmax_threshold", "target_sparsity", "disabled_until_timestep", "quant", "backend", "fallback", "policy")
#: Role keys that set skip-softmax.
_SKIP_KEYS = ("skip_softmax_threshold", "target_sparsity", "disabled_until_timestep")
#: Whole-role shortcuts: our kernel without skip/SAGE, or the family's own attention untouched.
_ROLE_MODES = ("dense", "stock")


@dataclass(frozen=True)
class Settings:
    """What a role asks for: skip-softmax, SAGE, route choice, or the stock path."""

    skip: SkipSoftmaxConfig
    quant: QuantConfig | None
    backend: str
    fallback: str | None
    mode: str = "trtllm"  # or "dense" / "stock"
    #: ``routing.policy.apply_policy``'s mode: "auto" drops what cannot pay off on a call, "always" honours it.
    policy: str = "auto"
    #: Features ("skip", "sage") the role's override set explicitly: honoured on every call.
    honour: frozenset[str] = frozenset()


def _role_settings(base: Mapping[str, Any], override: Any, role: str) -> Settings:
    if isinstance(override, str):
        if override not in _ROLE_MODES:
            raise ValueError(f"roles[{role!r}] must be a dict of overrides or one of {_ROLE_MODES}; got {override!r}.")
        return Settings(SkipSoftmaxConfig(), None, base["backend"], base["fallback"], override, base["policy"])
    if not isinstance(override, Mapping):
        raise ValueError(f"roles[{role!r}] must be a dict of overrides or one of {_ROLE_MODES}; got {override!r}.")
    unknown = set(override) - set(_ROLE_KEYS)
    if unknown:
        raise ValueError(unknown_keys_message(f"roles[{role!r}]", unknown, _ROLE_KEYS))
    kw = {**base, **override}
    if "skip_softmax_threshold" in override and override["skip_softmax_threshold"] is not None and "target_sparsity" not in override:
        kw["target_sparsity"] = None
    if "target_sparsity" in override and override["target_sparsity"] is not None and "skip_softmax_threshold" not in override:
        kw["skip_softmax_threshold"] = None
    skip = SkipSoftmaxConfig.from_kwargs(kw)
    quant = QuantConfig.coerce(kw["quant"])
    check_route_choice(kw["backend"], kw["fallback"], where=f" (role {role!r})")
    policy = override.get("policy", base["policy"])
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}; got {policy!r} (role {role!r}).")
    # What the user set explicitly for this role is honoured on every call.
    honour = frozenset(
        feature for feature, keys in (("skip", _SKIP_KEYS), ("sage", ("quant",))) if any(k in override for k in keys)
    )
    return Settings(skip, quant, kw["backend"], kw["fallback"], policy=policy, honour=honour)


class TrtllmAttnProcessor(PushToHubMixin):
    """Attention processor serving every layer of a Diffusers model with TRT-LLM kernels.

    Controls (names of vLLM-Omni's ``TRTLLM_ATTN`` backend): ``skip_softmax_threshold``
    or ``target_sparsity`` (needs a calibration, see ``load_calibration``),
    ``disabled_until_timestep`` (skip-softmax off while ``t`` is above it),
    ``quant`` (SAGE: ``{"dtype_qk": "int8"|"fp8_e4m3", "q_block_size", "k_block_size"}``),
    ``backend`` (``"auto"`` or a route name) and ``fallback`` (``"dense"`` to drop what no
    route can honour, with one warning). ``roles`` overrides any of these per attention
    role (``self``, ``cross``, ``joint``, ``refiner``), e.g. ``{"cross": {"quant": None},
    "refiner": "dense"}``; ``"stock"`` leaves a role on the family's own attention.
    ``collect_stats`` asks routes for skipped-tile counts (a debug cost on GPU kernels).
    ``policy="auto"`` runs a call dense where its skip/SAGE request cannot pay off (measured
    rules, :mod:`diffusers_trtllm.routing.policy`); what a role override sets explicitly (a skip control,
    ``quant``), or everything under ``policy="always"``, is honoured on every call.
    ``fused_rotary``: the family's rotary embedding (Wan, Flux, Flux.2, HunyuanVideo, LTX-Video, Qwen-Image,
    CogVideoX) runs as one launch of ours with the same values (True), or as the family's own code (False).
    ``fused_qk_norm``: Diffusers' ``RMSNorm`` QK norms (Qwen-Image, SD3.5, HunyuanVideo) run as one launch of ours (True;
    the sum of squares in another order: an element can differ by one rounding, rarely), or as Diffusers' own (False,
    the default until the kernel has run on a GPU).

    A setting saves and loads as Diffusers' configurations do (:mod:`diffusers_trtllm.setting`):
    ``proc.save_pretrained(folder, push_to_hub=False, repo_id=None)`` writes every constructor argument
    and the calibration the layers were given to one JSON file; ``push_to_hub(repo_id)``
    uploads it; ``TrtllmAttnProcessor.from_pretrained(repo_or_folder)`` builds the processor again, and
    ``install(pipe, proc)`` gives the layers that calibration.
    """

    #: Called as ``observer(layer, t, layout, query, key, scale)`` before each served call (``calibrate``'s pass).
    _call_observer: Any = None
    #: The calibration the served layers were given (``load_calibration``, or the file of ``from_pretrained``):
    #: what ``save_pretrained`` writes and ``install`` applies.
    _calibration: CalibrationRecord | None = None

    @_setting.records_arguments
    def __init__(
        self,
        skip_softmax_threshold: float | None = None,
        target_sparsity: float | None = None,
        disabled_until_timestep: float | None = None,
        quant: Mapping[str, Any] | QuantConfig | None = None,
        backend: str = "auto",
        fallback: str | None = None,
        roles: Mapping[str, Any] | None = None,
        collect_stats: bool = False,
        policy: str = "auto",
        fused_rotary: bool = True,
        fused_qk_norm: bool = False,
    ) -> None:
        base = {
            "skip_softmax_threshold": skip_softmax_threshold,
            "target_sparsity": target_sparsity,
            "disabled_until_timestep": disabled_until_timestep,
            "quant": quant,
            "backend": backend,
            "fallback": fallback,
            "policy": policy,
        }
        roles = dict(check_mapping("roles", roles or {}, "{'cross': 'dense', 'joint': {'quant': None}}"))
        unknown = set(roles) - set(ROLES)
        if unknown:
            raise ValueError(unknown_keys_message("roles", unknown, ROLES, what="roles"))
        #: What each role asks for, before any layer's calibration.
        self._role_settings = {role: _role_settings(base, roles.get(role, {}), role) for role in ROLES}
        # What the user set (not left at its default), per role: a checkpoint fills only the rest.
        defaults = {"backend": "auto", "policy": "auto"}
        given = {k for k, v in base.items() if v is not None and v != defaults.get(k)}
        self._explicit = {role: given | set(roles[role] if isinstance(roles.get(role), Mapping) else ()) for role in ROLES}
        self._built_without_arguments = (not given and not roles and not collect_stats and fused_rotary is True
                                         and fused_qk_norm is False)
        self.roles = roles
        for name, flag in (("collect_stats", collect_stats), ("fused_rotary", fused_rotary),
                           ("fused_qk_norm", fused_qk_norm)):
            if not isinstance(flag, bool):  # bool("no") would turn it on
                raise ControlTypeError(f"{name} must be True or False; got {flag!r:.60} ({type(flag).__name__}).")
        self.collect_stats = collect_stats
        #: Whether the family's rotary embedding runs as our one launch (``serving.rotary``) or as its own code.
        self._fused_rotary = fused_rotary
        #: Whether Diffusers' ``RMSNorm`` QK norms run as our one launch (``serving.qk_norm``) or as Diffusers' own.
        self._fused_qk_norm = fused_qk_norm
        self._init_runtime()
        #: A normalized t published with ``set_timestep`` (for layers outside any tracked transformer).
        self._t_value: float | None = None
        self._has_callback = False
        #: What Diffusers sets on "the" processor for the stock path (``_attention_backend``,
        #: ``_parallel_config``): forwarded to every layer's stock processor, now and on binding.
        self._stock_attrs: dict[str, Any] = {}

    def _init_runtime(self) -> None:
        # Diffusers' setters must hand ours the processor they replace from the first
        # ``set_attn_processor(proc)`` on, which no hook of ours sees: wrapped while this lives (serving.setters).
        hold_setters(self, TrtllmAttnProcessor)
        self._layers: "weakref.WeakSet[LayerState]" = weakref.WeakSet()
        #: States of modules this processor served until another processor (or ``uninstall``) took them,
        #: by module: they keep this processor's statistics until it serves the module again.
        self._retired: "weakref.WeakKeyDictionary[torch.nn.Module, LayerState]" = weakref.WeakKeyDictionary()
        #: The layout cache every layer shares (one mask packing per transformer forward).
        self._layouts = LayoutCache()

    # ---- copies and pickling: layers re-register themselves on restore -------------------------
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_layers", "_retired", "_layouts")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    # ---- saving and loading the setting (``setting``) ---------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, subfolder: str | None = None,
                        revision: str | None = None, cache_dir: str | os.PathLike | None = None,
                        local_files_only: bool | None = None, token: str | bool | None = None,
                        **kwargs: Any) -> "TrtllmAttnProcessor":
        """The processor saved with ``save_pretrained`` in a folder or a Hub repo, with its calibration (which
        ``install`` gives the layers, after checking they are the ones it was made for).

        Finding the file is Diffusers' ``load_config`` (``subfolder``, ``revision``, ``cache_dir``,
        ``local_files_only``, ``HF_HUB_OFFLINE``, ``token``; ``force_download`` and ``proxies`` too). Keyword
        arguments of the constructor override the file's (``from_pretrained(repo, quant=None)``). A newer
        format, a missing or malformed field, or another class's file raises ``SettingFileError`` (a
        ``ValueError``) in one line naming the file and the field.
        """
        names = _setting.constructor_parameters(cls)
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        unknown = set(kwargs) - {"force_download", "proxies"}
        if unknown:
            raise TypeError(unknown_keys_message("from_pretrained", unknown, [*names, "force_download", "proxies"],
                                                 what="keyword arguments"))
        found = _setting.read_setting(pretrained_model_name_or_path, cls, subfolder=subfolder, revision=revision,
                                      cache_dir=cache_dir, local_files_only=local_files_only, token=token, **kwargs)
        proc = _setting.build(cls, found, overrides)
        if found.calibration is not None:
            proc._calibration = CalibrationRecord(found.calibration, found.source)
        return proc

    def save_pretrained(self, save_directory: str | os.PathLike, push_to_hub: bool = False, repo_id: str | None = None,
                        **kwargs: Any) -> None:
        """Write the setting (``SETTING_FILE``: every constructor argument and the layers' calibration) into
        ``save_directory``; with ``push_to_hub``, upload the folder to ``repo_id`` (default: the folder's name)
        through Diffusers' ``save_config`` (``commit_message``, ``private``, ``token``, ``create_pr``,
        ``subfolder``). ``push_to_hub(repo_id)`` is Diffusers' ``PushToHubMixin``'s (it keeps the repo's card)."""
        kwargs.pop("safe_serialization", None)  # PushToHubMixin.push_to_hub passes these: a setting holds no weights
        kwargs.pop("variant", None)
        uncalibrated = self._calibration is None and any(s.calibration is not None for s in self._layers)
        if uncalibrated:
            raise ValueError("the layers this processor serves carry a calibration it was not given (it came with "
                             "the processor they had before); call load_calibration(pipe, ...) with this processor "
                             "installed, then save_pretrained.")
        if repo_id is not None:
            kwargs["repo_id"] = repo_id
        calibration = self._calibration.sections if self._calibration is not None else None
        _setting.save(_setting.setting_contents(self._arguments, calibration), save_directory, push_to_hub, **kwargs)

    def _check_machine(self) -> None:
        """Refuse, before any layer is served, settings no route of this machine can run: without CUDA only the
        CPU routes run, and ``backend="auto"`` never picks ``reference`` (the oracle), so skip-softmax or SAGE
        would fail at the first call. Decided by whether CUDA is available at all, not by where the model is
        now (``install`` then ``.to("cuda")`` is fine)."""
        if torch.cuda.is_available():
            return
        for role in ROLES:
            s = self._role_settings[role]
            if s.mode != "trtllm":
                continue
            if s.backend not in ("auto", *CPU_ROUTES):
                raise RuntimeError(
                    f"Pass backend='reference' (or 'sdpa' for dense attention) or run on a CUDA GPU: "
                    f"backend={s.backend!r} (role {role!r}) needs CUDA, and this machine has none.")
            wanted = [name for name, on in (("skip-softmax", s.skip.configured), ("SAGE", s.quant is not None)) if on]
            if s.backend == "auto" and wanted and s.fallback != "dense":
                raise RuntimeError(
                    f"Pass backend='reference' (the kernels' PyTorch oracle: right answers, no speed) or run on a "
                    f"CUDA GPU: this machine has no CUDA, and backend='auto' has no CPU route for "
                    f"{' and '.join(wanted)} (role {role!r}).")

    # ---- what a layer asks of its processor ------------------------------------------------------
    def _adopt(self, state: LayerState) -> None:
        """Serve ``state`` (a layer restored from a copy or a pickle)."""
        self._layers.add(state)
        layer_bound(self, TrtllmAttnProcessor)

    @property
    def _is_blank(self) -> bool:
        """Built with no arguments and never installed: what Diffusers makes when it rebuilds a processor by class."""
        return self._built_without_arguments and not self._layers and not self._retired

    def _release(self, module: torch.nn.Module, state: LayerState) -> None:
        """Stop serving ``state`` (``module`` was uninstalled or took another processor); its records stay in this
        processor's tables until it serves the module again."""
        self._layers.discard(state)
        state.unregister()
        self._retired[module] = state

    @property
    def _fallback_timestep(self) -> float | None:
        """The ``t`` published with ``set_timestep``, for layers whose tracker knows none."""
        return self._t_value

    @property
    def _step_callback_attached(self) -> bool:
        """Whether a ``DenoiseStepCallback`` publishes ``t`` (then the first step runs dense, said once)."""
        return self._has_callback

    def _attach_step_callback(self) -> None:
        """A ``DenoiseStepCallback`` was made for this processor."""
        self._has_callback = True

    def _explicit_settings(self, role: str) -> frozenset[str]:
        """The controls the user set for ``role`` (not left at their defaults): a checkpoint fills only the rest."""
        return frozenset(self._explicit[role])

    # ---- Diffusers' attention backend and parallel config: the stock processors' --------------
    def _set_on_stock(self, name: str, value: Any) -> None:
        self._stock_attrs[name] = value
        for state in list(self._layers):
            _forward_attr(state.stock, name, value)

    @property
    def _attention_backend(self) -> Any:
        return self._stock_attrs.get("_attention_backend")

    @_attention_backend.setter
    def _attention_backend(self, backend: Any) -> None:
        """``model.set_attention_backend(name)`` sets this: the stock path of every layer uses it."""
        self._set_on_stock("_attention_backend", backend)

    @property
    def _parallel_config(self) -> Any:
        return self._stock_attrs.get("_parallel_config")

    @_parallel_config.setter
    def _parallel_config(self, config: Any) -> None:
        """``model.enable_parallelism(config=...)`` sets this: every stock processor passes it to attention."""
        self._set_on_stock("_parallel_config", config)

    # ---- the processor call ---------------------------------------------------------------
    # ``__call__(attn, *args, <every keyword of the stock processors>, **kwargs)`` is made by ``_define_call``
    # (below the class) and hands what was passed to ``_process``.
    def _process(self, attn: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """Run ``attn``'s stock processor with its attention call served."""
        state = layer_of(attn)
        if state is None or state.processor is not self:
            state = self._bind(attn)
        if state.keywords is not None:  # what the module would have passed the stock processor (serving.keywords)
            kwargs = state.keywords.apply(kwargs)
        if state.mode is None:
            if state.stock is None:
                raise RuntimeError(
                    f"TrtllmAttnProcessor has no stock processor for {type(attn).__name__} ({state.reason}); "
                    "install it with diffusers_trtllm.install(model, proc) so the replaced processor is recorded."
                )
            return state.stock(attn, *args, **kwargs)
        return _intercept.call_stock(state, attn, args, kwargs)

    # ---- binding ----------------------------------------------------------------------
    def _bind(self, module: torch.nn.Module, replaced: Any = None, name: str | None = None,
             in_place: bool = False) -> LayerState:
        """Attach per-layer state to ``module`` (done on install; lazily otherwise); ``in_place``: ``replaced`` (an
        IP-Adapter's processor) stays the module's processor, and hooks on the module serve it
        (:mod:`diffusers_trtllm.serving.ip_adapter`)."""
        previous = layer_of(module)
        if isinstance(replaced, TrtllmAttnProcessor):
            replaced = None
        state = previous
        if previous is None or previous.processor is not self:
            self._retired.pop(module, None)  # served again: its old records give way to a new run
            state = LayerState(self, name=name)
            if previous is not None:
                state.take_over(previous)
                previous.processor._release(module, previous)
            attach_layer(module, state)
        if name is not None:
            state.name = name
        if in_place:
            stock = replaced
        elif replaced is not None:
            stock = copy.copy(replaced)
        elif state.stock is not None:
            stock = state.stock
        elif restored_stock(module) is not None:  # put back by Diffusers' own setter after uninstall
            stock = restored_stock(module)
        elif getattr(module, "_default_processor_cls", None) is not None:
            stock = module._default_processor_cls()
        else:
            stock = None
            state.reason = "the processor it replaced is unknown"
        for attr, value in self._stock_attrs.items():
            if value is not None:
                _forward_attr(stock, attr, value)
        state.set_stock(stock, module, in_place=in_place)
        if in_place:
            serve_in_place(module)
        else:
            stop_serving_in_place(module)
        _accept_keywords(stock)
        state.refresh()
        self._layers.add(state)
        layer_bound(self, TrtllmAttnProcessor)
        return state

    def _stock_processor(self, attn: torch.nn.Module) -> Any:
        """The family processor doing ``attn``'s work around its attention call (None when none is known)."""
        state = layer_of(attn)
        return state.stock if state is not None else None

    @property
    def layers(self) -> list[LayerState]:
        """States of the layers this processor serves, in binding order."""
        return sorted(self._layers, key=lambda s: int(s.key))

    def _recorded_layers(self) -> list[LayerState]:
        """The layers whose calls this processor's tables show: those it serves, and those it served until
        another processor or ``uninstall`` took them."""
        return self.layers + sorted(self._retired.values(), key=lambda s: int(s.key))

    def _settings_for(self, state: LayerState) -> Settings:
        """What ``state``'s layer runs: its role's settings, with its calibration (or ``ignore``) applied."""
        settings = self._role_settings[state.role]
        if settings.mode != "trtllm":
            return settings
        skip = settings.skip
        cal = state.calibration
        if state.ignored:
            skip = SkipSoftmaxConfig()
        elif cal is not None:
            if not skip.configured and cal.target_sparsity is not None:
                # Nothing asked by the user: the checkpoint's recommended operating point applies.
                skip = SkipSoftmaxConfig(target_sparsity=cal.target_sparsity,
                                         disabled_until_timestep=skip.disabled_until_timestep)
            if skip.target_sparsity is not None:
                skip = skip.with_calibration(cal.a, cal.b)
                if "disabled_until_timestep" not in self._explicit_settings(state.role) and cal.disabled_until_timestep:
                    skip = replace(skip, disabled_until_timestep=cal.disabled_until_timestep)  # an explicit one wins
        return replace(settings, skip=skip)

    # ---- timestep ------------------------------------------------------------------------
    def set_timestep(self, t: float | None) -> None:
        """Publish the normalized timestep (1 = noise, 0 = clean) of the next calls of every layer served: a number,
        a one-element tensor (a custom loop's ``timestep / 1000``) or None."""
        if isinstance(t, torch.Tensor) and t.numel() == 1:
            t = t.item()
        if t is not None and (isinstance(t, bool) or not isinstance(t, numbers.Real)):  # float("0.5") would take text
            raise ControlTypeError(f"t must be a number in [0, 1] or None; got {t!r:.60} ({type(t).__name__}).")
        if t is not None and not 0.0 <= float(t) <= 1.0:
            raise ValueError(f"t must be a normalized timestep in [0, 1] (raw timestep / num_train_timesteps); got {t!r}.")
        self._t_value = None if t is None else float(t)
        for tracker in self._trackers():
            tracker.publish(self._t_value)

    def _trackers(self) -> list[Any]:
        found: dict[int, Any] = {}
        for state in list(self._layers):
            if state.tracker is not None:
                found[id(state.tracker)] = state.tracker
        return list(found.values())

    # ---- statistics ----------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Forget recorded calls and restart the step count (a new pipeline run)."""
        for state in self._recorded_layers():
            state.stats.clear()
            state.calls = 0
        for tracker in self._trackers():
            tracker.reset()

    def step_table(self) -> list[dict[str, Any]]:
        """Per step: t, dense or sparse (``gated``: dense because of the timestep), skipped tiles, SAGE, routes."""
        return stats.step_table(self._recorded_layers())

    def layer_step_rows(self) -> list[dict[str, Any]]:
        """Per layer and step: layer, role, step, t, route, sparse, skipped fraction, SAGE, calls."""
        return stats.layer_step_rows(self._recorded_layers())

    def format_step_table(self) -> str:
        """The step table as text, with where the settings came from on top."""
        return stats.format_step_table(self.step_table(), self._recorded_layers())

    def summary(self) -> list[dict[str, Any]]:
        """Per layer and step: what ran (``dense (gated)`` too), skipped fraction, the SAGE dtype that ran,
        route, and where each setting came from; ``pandas.DataFrame(proc.summary())`` makes it a table."""
        return stats.summary(self._recorded_layers())

    def plot(self, path: str, title: str | None = None) -> str:
        """Heatmap of the skipped-tile fraction, layers x steps, saved to ``path`` (needs matplotlib)."""
        return stats.plot(self._recorded_layers(), path, title)

    def __repr__(self) -> str:
        """The controls in the parameter table's terms (an unset gate is None, as the table says), the others where
        they differ from their defaults, and how many layers it serves."""
        s = self._role_settings["self"]
        shown = {"skip_softmax_threshold": s.skip.threshold, "target_sparsity": s.skip.target_sparsity,
                 "disabled_until_timestep": s.skip.disabled_until_timestep or None,
                 "quant": s.quant.dtype_qk if s.quant else None, "backend": s.backend}
        others = {"fallback": (s.fallback, None), "roles": (self.roles or None, None), "policy": (s.policy, "auto"),
                  "collect_stats": (self.collect_stats, False), "fused_rotary": (self._fused_rotary, True),
                  "fused_qk_norm": (self._fused_qk_norm, False)}
        shown.update({name: value for name, (value, default) in others.items() if value != default})
        return f"TrtllmAttnProcessor({', '.join(f'{k}={v!r}' for k, v in shown.items())}, layers={len(self._layers)})"


def _forward_attr(stock: Any, name: str, value: Any) -> None:
    """Set a Diffusers processor attribute on a stock processor that has it."""
    if stock is not None and hasattr(stock, name):
        setattr(stock, name, value)


# ---- the keywords our __call__ names ------------------------------------------------------------
#: Diffusers' attention modules pass a keyword on only if the processor's signature names it (a
#: ``**kwargs`` catch-all receives nothing), so ours names every keyword of the stock processors it
#: has replaced, read from the installed Diffusers with ``inspect``.
_KEYWORDS: set[str] = {"hidden_states", "encoder_hidden_states", "attention_mask"}


class _Unset:
    """The default of every keyword our ``__call__`` names: the caller did not pass it."""

    def __repr__(self) -> str:
        return "<not passed>"


_UNSET = _Unset()
#: Names the generated ``__call__`` uses itself, never taken as keywords.
_OWN_NAMES = frozenset({"self", "attn", "args", "kwargs", "given"})


def _define_call() -> None:
    """Make ``TrtllmAttnProcessor.__call__`` a plain function whose parameters name ``_KEYWORDS``.

    A real function, not a ``__signature__``: ``torch.compile`` reads a real function's signature
    itself, where a ``Signature`` object's parameter mapping breaks a full graph (Flux reads the
    signature on every call). Each keyword defaults to ``_UNSET``, so only what the caller passed
    reaches the stock processor.
    """
    names = sorted(_KEYWORDS)
    source = (f"def __call__(self, attn, /, *args, {', '.join(f'{n}=_UNSET' for n in names)}, **kwargs):\n"
              f"    given = {{{', '.join(f'{n!r}: {n}' for n in names)}}}\n"
              f"    kwargs.update({{k: v for k, v in given.items() if v is not _UNSET}})\n"
              f"    return self._process(attn, args, kwargs)\n")
    namespace: dict[str, Any] = {"_UNSET": _UNSET}
    exec(source, namespace)  # noqa: S102 - the names are parameter names read from Diffusers' processors
    call = namespace["__call__"]
    call.__doc__ = TrtllmAttnProcessor._process.__doc__
    call.__qualname__ = "TrtllmAttnProcessor.__call__"
    call.__module__ = __name__
    TrtllmAttnProcessor.__call__ = call  # type: ignore[method-assign]


def _keywords_of(processor_cls: type) -> set[str]:
    try:
        params = inspect.signature(processor_cls.__call__).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - _OWN_NAMES


def _accept_keywords(stock: Any) -> None:
    """Name the stock processor's keywords in our ``__call__`` signature too."""
    names = _keywords_of(type(stock)) if stock is not None else set()
    if not names <= _KEYWORDS:
        _KEYWORDS.update(names)
        _define_call()


def _seed_keywords() -> None:
    """Every keyword of the processors in Diffusers' ``attention_processor`` (before any is replaced)."""
    from diffusers.models import attention_processor

    for obj in vars(attention_processor).values():
        if isinstance(obj, type) and obj.__module__ == attention_processor.__name__ and "__call__" in vars(obj):
            _KEYWORDS.update(_keywords_of(obj))


_seed_keywords()
_define_call()
