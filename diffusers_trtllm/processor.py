"""``TrtllmAttnProcessor``: one shared attention processor for any Diffusers transformer.

Install it like any processor::

    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.05, disabled_until_timestep=0.9,
                               quant={"dtype_qk": "int8"}, roles={"cross": "dense"})
    pipe.transformer.set_attn_processor(proc)

Every attention module keeps its family's stock processor (projections, QK norm,
RoPE stay Diffusers'); only the core attention call is routed to our kernels
(see :mod:`diffusers_trtllm.families`). Per-layer state (role, calibration,
statistics) lives on the module it serves, as ``module._trtllm_layer``.

Diffusers' ``set_processor`` keeps no record of the processor it replaces, and an
old ``attention_processor.Attention`` module does not name its stock processor, so
the first ``TrtllmAttnProcessor`` built wraps ``set_processor`` (of ``Attention`` and
``AttentionModuleMixin``) to hand the replaced processor to ours, and
``AttentionMixin.set_attn_processor`` to tell each layer its module name. Both
wrappers only act when the new processor is a ``TrtllmAttnProcessor``; importing
this package changes nothing in Diffusers.
"""

from __future__ import annotations

import copy
import functools
import inspect
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch

from . import families
from ._logging import info_once, logger, warn_once
from .attention import build_layout, check_route_choice, run_attention
from .config import QuantConfig, SkipSoftmaxConfig, check_mapping, unknown_keys_message
from .layout import LayoutCache, MaskNotSupportedError, PackedLayout
from .policy import POLICIES

__all__ = ["TrtllmAttnProcessor", "LayerState", "StepRecord", "Calibration", "ROLES"]

#: Attention roles a layer can have (see ``families.infer_role``).
ROLES = ("self", "cross", "joint", "refiner")
#: Keys a per-role override may set.
_ROLE_KEYS = ("skip_softmax_threshold", "target_sparsity", "disabled_until_timestep", "quant", "backend", "fallback", "policy")
#: Whole-role shortcuts: our kernel without skip/SAGE, or the family's own attention untouched.
_ROLE_MODES = ("dense", "stock")


@dataclass(frozen=True)
class Calibration:
    """One layer's skip-softmax curve ``factor = a * exp(b * target_sparsity)`` and checkpoint defaults."""

    a: float
    b: float
    target_sparsity: float | None = None
    disabled_until_timestep: float | None = None
    source: str = ""


@dataclass(frozen=True)
class _Settings:
    """What a role asks for: skip-softmax, SAGE, route choice, or the stock path."""

    skip: SkipSoftmaxConfig
    quant: QuantConfig | None
    backend: str
    fallback: str | None
    mode: str = "trtllm"  # or "dense" / "stock"
    #: ``policy.apply_policy``'s mode: "auto" drops what cannot pay off on a call, "always" honours it.
    policy: str = "auto"


@dataclass
class StepRecord:
    """One attention call: which route ran and what it did, at which denoising step."""

    step: int
    t: float | None
    route: str
    sparse: bool
    sage: bool
    skipped_tiles: int | None = None
    total_tiles: int | None = None
    #: What the policy dropped from the request on this call, and why (None: nothing).
    note: str | None = None


@dataclass(eq=False)
class LayerState:
    """Per-layer state, owned by the attention module it serves (``module._trtllm_layer``)."""

    processor: "TrtllmAttnProcessor"
    name: str | None = None
    role: str = "self"
    stock: Any = None
    mode: str | None = None
    reason: str = ""
    calibration: Calibration | None = None
    ignored: bool = False
    records: list[StepRecord] = field(default_factory=list)
    layer_id: int = 0
    #: Positions/names of the stock processor's mask arguments (for the layout cache key).
    mask_params: tuple[tuple[int, str], ...] = ()
    _settings: _Settings | None = None

    def __post_init__(self) -> None:
        self.layer_id = families.register_layer(self)

    @property
    def label(self) -> str:
        return self.name or f"<{self.role} attention #{self.layer_id}>"

    def set_stock(self, stock: Any, module: torch.nn.Module) -> None:
        """Adopt ``stock`` as the family processor that does everything but the attention call."""
        self.stock = stock
        self.mode, self.reason = (None, "no stock processor is known") if stock is None else families.serving_mode(stock)
        if self.mode is None:
            warn_once(("unserved", type(stock).__name__), "TrtllmAttnProcessor: %s keeps its stock attention: %s.",
                      self.label, self.reason)
            return
        families.install_routing(stock, self.mode)
        if self.mode == "dispatch":
            previous = getattr(stock, "_attention_backend", None)
            if isinstance(previous, families.LayerBackend):
                previous = previous.stock_backend
            stock._attention_backend = families.LayerBackend(self, previous)
        params = list(inspect.signature(type(stock).__call__).parameters)[2:]  # after self, attn
        self.mask_params = tuple((i, p) for i, p in enumerate(params) if "mask" in p)
        self.role = families.infer_role(self.name, module, stock)

    def settings(self) -> _Settings:
        if self._settings is None:
            self._settings = self.processor._settings_for(self)
        return self._settings

    def refresh(self) -> None:
        """Forget cached settings after the processor, role or calibration changed."""
        self._settings = None

    def serve(self, query, key, value, attn_mask, mask_source, timestep, scale) -> torch.Tensor:
        return self.processor._serve(self, query, key, value, attn_mask, mask_source, timestep, scale)

    def stock_attention(self, query, key, value, attn_mask, scale) -> torch.Tensor:
        """The family's own attention for this call (``[B, S, H, D]``)."""
        if self.mode == "sdpa":
            return families.stock_sdpa(query, key, value, attn_mask, scale)
        backend = self.stock._attention_backend.stock_backend
        return families.original_dispatch(self.stock)(
            query, key, value, attn_mask=attn_mask, scale=scale, enable_gqa=key.shape[2] != query.shape[2], backend=backend
        )


def _role_settings(base: Mapping[str, Any], override: Any, role: str) -> _Settings:
    if isinstance(override, str):
        if override not in _ROLE_MODES:
            raise ValueError(f"roles[{role!r}] must be a dict of overrides or one of {_ROLE_MODES}; got {override!r}.")
        return _Settings(SkipSoftmaxConfig(), None, base["backend"], base["fallback"], override, base["policy"])
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
    # A role the user configured explicitly is honoured on every call unless it names a policy itself.
    policy = override.get("policy", "always" if override else base["policy"])
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}; got {policy!r} (role {role!r}).")
    return _Settings(skip, quant, kw["backend"], kw["fallback"], policy=policy)


class TrtllmAttnProcessor:
    """Attention processor serving every layer of a Diffusers transformer with TRT-LLM kernels.

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
    rules, :mod:`diffusers_trtllm.policy`); an explicit per-role setting, or ``policy="always"``,
    is honoured on every call.
    """

    def __init__(
        self,
        skip_softmax_threshold: float | None = None,
        target_sparsity: float | None = None,
        disabled_until_timestep: float = 0.0,
        quant: Mapping[str, Any] | QuantConfig | None = None,
        backend: str = "auto",
        fallback: str | None = None,
        roles: Mapping[str, Any] | None = None,
        collect_stats: bool = False,
        policy: str = "auto",
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
        _patch_diffusers()
        roles = dict(check_mapping("roles", roles or {}, "{'cross': 'dense', 'joint': {'quant': None}}"))
        unknown = set(roles) - set(ROLES)
        if unknown:
            raise ValueError(unknown_keys_message("roles", unknown, ROLES, what="roles"))
        self._role_settings = {role: _role_settings(base, roles.get(role, {}), role) for role in ROLES}
        self.roles = roles
        self.collect_stats = bool(collect_stats)
        self._layers: "weakref.WeakSet[LayerState]" = weakref.WeakSet()
        self._layouts = LayoutCache()
        self._dense_layouts: dict[tuple, PackedLayout] = {}
        # Denoising timestep: a tensor handed over by attach_denoise_tracking's hook (read in the op)
        # or a float published by DenoiseStepCallback / set_timestep.
        self._t_tensor: torch.Tensor | None = None
        self._t_normalizer: Any = None
        self._t_value: float | None = None
        self._t_cache: tuple | None = None
        self._has_callback = False
        self._last_t: float | None = None
        self._calls_in_step = 0
        self.step = 0

    @property
    def skip(self) -> SkipSoftmaxConfig:
        return self._role_settings["self"].skip

    @property
    def quant(self) -> QuantConfig | None:
        return self._role_settings["self"].quant

    # ---- the processor call ---------------------------------------------------------------
    def __call__(self, attn: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = getattr(attn, "_trtllm_layer", None)
        if state is None or state.processor is not self:
            state = self.bind(attn)
        if state.mode is None or state.settings().mode == "stock":
            if state.stock is None:
                raise RuntimeError(
                    f"TrtllmAttnProcessor has no stock processor for {type(attn).__name__} ({state.reason}); "
                    "install it with transformer.set_attn_processor(proc) so the replaced processor is recorded."
                )
            return state.stock(attn, *args, **kwargs)
        call = families.CURRENT_CALL
        call.state = state
        call.mask_source = _mask_source(state.mask_params, args, kwargs)
        call.timestep = self._t_tensor
        try:
            return state.stock(attn, *args, **kwargs)
        finally:
            call.state = None
            call.mask_source = None
            call.timestep = None

    # ---- binding ----------------------------------------------------------------------
    def bind(self, module: torch.nn.Module, replaced: Any = None, name: str | None = None) -> LayerState:
        """Attach per-layer state to ``module`` (done by ``set_attn_processor``; lazily otherwise)."""
        state = module.__dict__.get("_trtllm_layer")
        if isinstance(replaced, TrtllmAttnProcessor):
            replaced = None
        if state is None:
            state = LayerState(self, name=name)
            module._trtllm_layer = state
        elif state.processor is not self:
            state.records.clear()
        state.processor = self
        if name is not None:
            state.name = name
        if replaced is not None:
            stock = copy.copy(replaced)
        elif state.stock is not None:
            stock = state.stock
        elif getattr(module, "_default_processor_cls", None) is not None:
            stock = module._default_processor_cls()
        else:
            stock = None
            state.reason = "the processor it replaced is unknown"
        state.set_stock(stock, module)
        state.refresh()
        self._layers.add(state)
        return state

    @property
    def layers(self) -> list[LayerState]:
        """States of the layers this processor serves, in binding order."""
        return sorted(self._layers, key=lambda s: s.layer_id)

    def _settings_for(self, state: LayerState) -> _Settings:
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
                skip = SkipSoftmaxConfig(
                    target_sparsity=cal.target_sparsity,
                    disabled_until_timestep=cal.disabled_until_timestep or 0.0,
                )
            if skip.target_sparsity is not None:
                skip = skip.with_calibration(cal.a, cal.b)
        return replace(settings, skip=skip)

    # ---- serving one call (inside the custom op) ----------------------------------------
    def _layout(self, state: LayerState, query, key, attn_mask, mask_source) -> PackedLayout:
        batch, q_len, kv_len = query.shape[0], query.shape[1], key.shape[1]
        if attn_mask is None:
            dense_key = (batch, q_len, kv_len, query.device)
            layout = self._dense_layouts.get(dense_key)
            if layout is None:
                layout = self._dense_layouts[dense_key] = PackedLayout.dense(batch, q_len, kv_len, query.device)
            return layout
        if mask_source is None:
            return build_layout(query, key, attn_mask, self._layouts)
        # The family builds its mask from ``mask_source`` afresh in every layer (Qwen-Image, LTX):
        # key the cache on the source so one forward pays one sync.
        extra = (batch, q_len, kv_len, tuple(attn_mask.shape), attn_mask.dtype, type(state.stock))
        return self._layouts.get(mask_source, extra, lambda: build_layout(query, key, attn_mask))

    def _serve(self, state: LayerState, query, key, value, attn_mask, mask_source, timestep, scale) -> torch.Tensor:
        settings = state.settings()
        if settings.mode == "stock":
            return state.stock_attention(query, key, value, attn_mask, scale)
        t = self._timestep(timestep)
        if query.shape[1] == 0 or key.shape[1] == 0:
            self._record(state, t, "stock", False, False, None)
            return state.stock_attention(query, key, value, attn_mask, scale)
        try:
            layout = self._layout(state, query, key, attn_mask, mask_source)
        except MaskNotSupportedError as err:
            warn_once(("stock-mask", state.role, type(state.stock).__name__),
                      "TrtllmAttnProcessor: %s attention (%s) keeps its stock path: %s", state.role, state.label, err)
            self._record(state, t, "stock", False, False, None)
            return state.stock_attention(query, key, value, attn_mask, scale)
        skip = settings.skip if settings.mode == "trtllm" else None
        quant = settings.quant if settings.mode == "trtllm" else None
        if skip is not None and skip.configured and skip.gated and t is None and self._has_callback:
            info_once(("first-step-dense", id(self)),
                      "DenoiseStepCallback publishes t after each step, so the first step runs dense; "
                      "attach_denoise_tracking(pipe, proc) knows t before every step.")
            skip = None
        out, result = run_attention(
            query, key, value, layout=layout, softmax_scale=scale, skip=skip, quant=quant, timestep=t,
            backend=settings.backend, fallback=settings.fallback, role=state.role, collect_stats=self.collect_stats,
            policy=settings.policy,
        )
        self._record(state, t, result.route, result.sparse, result.sage, result)
        return out

    def _record(self, state: LayerState, t, route: str, sparse: bool, sage: bool, result) -> None:
        self._calls_in_step += 1
        state.records.append(StepRecord(
            self.step, t, route, sparse, sage,
            getattr(result, "skipped_tiles", None), getattr(result, "total_tiles", None), getattr(result, "note", None),
        ))

    # ---- timestep ------------------------------------------------------------------------
    def set_timestep(self, t: float | None) -> None:
        """Publish the normalized timestep (1 = noise, 0 = clean) of the next transformer call."""
        if t is not None and not 0.0 <= float(t) <= 1.0:
            raise ValueError(f"t must be a normalized timestep in [0, 1] (raw timestep / num_train_timesteps); got {t!r}.")
        self._t_value = None if t is None else float(t)
        if t is not None:
            self._observe(float(t))

    @property
    def current_timestep(self) -> float | None:
        return self._t_cache[2] if self._t_tensor is not None and self._t_cache else self._t_value

    def _timestep(self, tensor: torch.Tensor | None) -> float | None:
        if tensor is None or self._t_normalizer is None:
            return self._t_value
        hit = self._t_cache
        if hit is not None and hit[0]() is tensor and hit[1] == tensor._version:
            return hit[2]
        t = self._t_normalizer(float(tensor.reshape(-1)[0]))  # one sync per transformer forward
        self._t_cache = (weakref.ref(tensor), tensor._version, t)
        self._observe(t)
        return t

    def _observe(self, t: float) -> None:
        """Advance the step counter when t changes; a rising t starts a new run (stats restart)."""
        last = self._last_t
        if last is not None and t > last + 1e-6:
            self.reset_stats()
        elif t != last and self._calls_in_step:
            self.step += 1
            self._calls_in_step = 0
        self._last_t = t

    # ---- statistics ----------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Forget recorded calls and restart the step count (a new pipeline run)."""
        for state in self._layers:
            state.records.clear()
        self.step = 0
        self._calls_in_step = 0
        self._last_t = None

    def step_table(self) -> list[dict[str, Any]]:
        """Per step: t, dense or sparse, skipped-tile fraction, SAGE on/off, routes, calls."""
        steps: dict[int, dict[str, Any]] = {}
        for state in self.layers:
            for r in state.records:
                row = steps.setdefault(r.step, {"step": r.step, "t": r.t, "sparse_calls": 0, "calls": 0,
                                                "skipped": 0, "tiles": 0, "sage": False, "routes": set(),
                                                "notes": set()})
                row["calls"] += 1
                row["sparse_calls"] += int(r.sparse)
                row["sage"] |= r.sage
                row["routes"].add(r.route)
                if r.note:
                    row["notes"].add(f"{state.role}: {r.note}")
                if r.total_tiles:
                    row["skipped"] += r.skipped_tiles
                    row["tiles"] += r.total_tiles
        table = []
        for step in sorted(steps):
            row = steps[step]
            table.append({
                "step": step,
                "t": row["t"],
                "mode": "sparse" if row["sparse_calls"] else "dense",
                "sparse_calls": row["sparse_calls"],
                "calls": row["calls"],
                "skipped_fraction": row["skipped"] / row["tiles"] if row["tiles"] else None,
                "sage": row["sage"],
                "routes": ",".join(sorted(row["routes"])),
                "policy": "; ".join(sorted(row["notes"])),
            })
        return table

    def format_step_table(self) -> str:
        lines = [f"{'step':>4}  {'t':>6}  {'attention':<9}  {'skipped':>7}  {'SAGE':<4}  route"]
        for row in self.step_table():
            t = "   n/a" if row["t"] is None else f"{row['t']:6.3f}"
            skipped = "    n/a" if row["skipped_fraction"] is None else f"{row['skipped_fraction']:7.1%}"
            policy = f"  ({row['policy']})" if row["policy"] else ""
            lines.append(f"{row['step']:>4}  {t}  {row['mode']:<9}  {skipped}  {'on' if row['sage'] else 'off':<4}  {row['routes']}{policy}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        s, q = self._role_settings["self"], self._role_settings["self"].quant
        return (f"TrtllmAttnProcessor(skip_softmax_threshold={s.skip.threshold}, target_sparsity={s.skip.target_sparsity}, "
                f"disabled_until_timestep={s.skip.disabled_until_timestep}, quant={q.dtype_qk if q else None}, "
                f"backend={s.backend!r}, layers={len(self._layers)})")


def _mask_source(mask_params: tuple[tuple[int, str], ...], args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The one mask tensor the caller passed (the family derives its attention mask from it), else None."""
    found = None
    for index, name in mask_params:
        value = kwargs.get(name) if name in kwargs else (args[index] if index < len(args) else None)
        if value is not None:
            if found is not None:
                return None
            found = value
    return found if isinstance(found, torch.Tensor) else None


def _call_signature() -> inspect.Signature:
    """``(self, attn, *args, <every keyword a Diffusers processor takes>, **kwargs)``.

    Diffusers' attention modules pass a keyword on only if the processor's signature
    names it (a ``**kwargs`` catch-all receives nothing), so ours names them all; the
    call forwards exactly what it received to the stock processor.
    """
    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_ONLY), P("attn", P.POSITIONAL_ONLY), P("args", P.VAR_POSITIONAL)]
    params += [P(name, P.KEYWORD_ONLY, default=None) for name in _PROCESSOR_KEYWORDS]
    params.append(P("kwargs", P.VAR_KEYWORD))
    return inspect.Signature(params)


#: Keyword parameters of the processors shipped in Diffusers 0.42 (collected from their ``__call__``).
_PROCESSOR_KEYWORDS = (
    "hidden_states", "encoder_hidden_states", "attention_mask", "all_perturbed", "attn_mask", "audio_rotary_emb",
    "base_sequence_length", "batch_flag", "block_mask", "cache_write_slice", "cached_txt_key", "cached_txt_value",
    "context", "context_mask", "encoder_hidden_states_image", "encoder_hidden_states_mask",
    "encoder_position_embeddings", "freqs_cis", "gen_seq", "grid_sizes", "hidden_states_masks",
    "image_embed_seq_len", "image_rotary_emb", "ip_adapter_masks", "ip_hidden_states", "key_rotary_emb",
    "key_valid", "kv_cache", "kv_cache_flag", "kv_cache_mode", "latent_attn_mask", "layer_cache", "mask",
    "num_ref_tokens", "num_txt_tokens", "origin_latent_frames", "origin_latent_hw", "original_context_length",
    "pairs", "perturbation_mask", "position_embeddings", "post_attention_mask", "prompt_rotary_emb",
    "query_rotary_emb", "reference_grid_sizes", "reference_rope_stride", "reference_rotary_emb", "rope",
    "rope_stride", "rotary_emb", "rotary_emb_kv", "scale", "segments", "sink_rotary_emb", "sparse_params",
    "temb", "text_attn_mask",
)
TrtllmAttnProcessor.__call__.__signature__ = _call_signature()  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=1)
def _patch_diffusers() -> None:
    """Wrap Diffusers' processor setters (once) so installing ours records the processor it replaces."""
    from diffusers.models.attention import AttentionMixin, AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    for cls in (AttentionModuleMixin, Attention):
        original = cls.set_processor
        if getattr(original, "_trtllm_wrapped", False):
            continue

        @functools.wraps(original)
        def set_processor(self, processor, _original=original):
            replaced = getattr(self, "processor", None)
            _original(self, processor)
            if isinstance(processor, TrtllmAttnProcessor):
                processor.bind(self, replaced=replaced)

        set_processor._trtllm_wrapped = True
        cls.set_processor = set_processor

    original_set = AttentionMixin.set_attn_processor
    if getattr(original_set, "_trtllm_wrapped", False):
        return

    @functools.wraps(original_set)
    def set_attn_processor(self, processor):
        original_set(self, processor)
        for name, module in self.named_modules():
            state = module.__dict__.get("_trtllm_layer")
            if state is not None and isinstance(getattr(module, "processor", None), TrtllmAttnProcessor):
                state.name = name
                state.role = families.infer_role(name, module, state.stock)
                state.refresh()
        logger.debug("TrtllmAttnProcessor installed on %s", type(self).__name__)

    set_attn_processor._trtllm_wrapped = True
    AttentionMixin.set_attn_processor = set_attn_processor
