"""Per-layer state, owned by the attention module it serves (``layer_of(module)``).

A :class:`LayerState` knows the module's stock processor (which does everything but
the attention call), how its call is intercepted, its role, calibration, timestep
tracker and step statistics, and serves one intercepted call (:meth:`LayerState.serve`,
run inside the custom op). The processor it belongs to holds only settings.

Copies: ``copy.deepcopy`` and ``pickle`` give the copy its own registration (a new key),
so a copied model is served by its own layers, never by the original's. See docs/design.md.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from .._logging import info_once, warn_once
from ..attention import _run_nhd, build_layout
from ..config import SkipSoftmaxConfig
from ..layout import MaskNotSupportedError, PackedLayout, query_key_masks
from ..stats import LayerStats, StepRecord
from . import intercept
from .keywords import KeywordFilter, keyword_filter
from .qk_norm import fuse_rms_norm, takes_norms_of
from .roles import guess_role, observed_role
from .rotary import DeferredRotary, deferred_rotary

if TYPE_CHECKING:
    from .processor import Settings, TrtllmAttnProcessor
    from .timestep import TimestepTracker

__all__ = ["LayerState", "Calibration", "LAYER_ATTR", "layer_of", "attach_layer", "detach_layer", "check_calibrated"]

#: The attribute of an attention module that holds its ``LayerState`` (only this module spells it).
LAYER_ATTR = "_trtllm_layer"


def layer_of(module: torch.nn.Module) -> "LayerState | None":
    """The state our processor keeps on ``module``, or None when none of ours serves it. An attribute lookup, which
    Dynamo guards (a read of ``module.__dict__`` it did not: blocks compiled before the layer was bound bound it
    again on every forward)."""
    return getattr(module, LAYER_ATTR, None)


#: Counts the changes that can change a layer's ``needs_calibration`` (a state put on or taken off a module, a
#: state's settings or calibration renewed): ``check_calibrated`` walks a model again only after one.
_changes = 0
#: The model attribute holding the count at which the model last passed ``check_calibrated``.
_CHECKED_ATTR = "_trtllm_calibration_checked"


def _changed() -> None:
    global _changes
    _changes += 1


def attach_layer(module: torch.nn.Module, state: "LayerState") -> None:
    module.__dict__[LAYER_ATTR] = state
    _changed()


def detach_layer(module: torch.nn.Module) -> "LayerState | None":
    """Take the state off ``module`` (returned, or None when it had none)."""
    _changed()
    return module.__dict__.pop(LAYER_ATTR, None)


def check_calibrated(model: torch.nn.Module) -> None:
    """Refuse, before any layer of ``model`` runs, a ``target_sparsity`` that no calibration backs (one line).
    Called before every forward: the walk over the model's modules (about 0.9 ms for Flux.1-dev's 1,279 on a
    2-core CPU) is made again only after a layer changed."""
    if model.__dict__.get(_CHECKED_ATTR) == _changes:
        return
    missing = [state.label for m in model.modules() if (state := layer_of(m)) is not None and state.needs_calibration]
    if missing:
        shown = missing[0] + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        raise ValueError(
            f"Load a calibration with load_calibration(pipe, path_or_repo), make one with calibrate(pipe, prompts), "
            f"or pass skip_softmax_threshold instead: target_sparsity has no calibration for {shown} of "
            f"{type(model).__name__}."
        )
    model.__dict__[_CHECKED_ATTR] = _changes


@dataclass(frozen=True)
class Calibration:
    """One layer's skip-softmax curve ``factor = a * exp(b * target_sparsity)`` and checkpoint defaults."""

    a: float
    b: float
    target_sparsity: float | None = None
    disabled_until_timestep: float | None = None
    source: str = ""


@dataclass(frozen=True)
class _MaskPlan:
    """How a masked call runs: our kernel over ``layout``; queries at ``padded`` (per batch row) stock.
    ``layout`` None: unmasked, laid out by ``run_attention`` (from the processor's layout cache, so every layer of a
    shape shares one: FlashInfer plans once per layout) within the plan it keeps for the call's shapes."""

    layout: PackedLayout | None
    padded: tuple[Optional[torch.Tensor], ...] = ()


_UNMASKED = _MaskPlan(None)


class LayerState:
    """Everything about one served attention module; see the module docstring."""

    def __init__(self, processor: "TrtllmAttnProcessor", name: str | None = None) -> None:
        self.processor = processor
        self.name = name
        self.role = "self"
        #: True once a call settled the role (see ``serving.roles``).
        self.role_observed = False
        self.stock: Any = None
        #: The stock processor a ``fuse_qkv_projections()`` replaced, put back when the model unfuses.
        self.unfused_stock: Any = None
        self.mode: str | None = None
        self.reason = ""
        self.calibration: Calibration | None = None
        self.ignored = False
        self.tracker: "TimestepTracker | None" = None
        self.stats = LayerStats()
        self.calls = 0
        self.module_is_cross: Any = None
        #: Positions/names of the stock processor's mask arguments, hidden and encoder states.
        self.mask_params: tuple[tuple[int, str], ...] = ()
        self.hidden_index: int | None = None
        self.encoder_index: int | None = None
        #: The stock processor's rotation, when we apply it at the attention call (``serving.rotary``).
        self.rotary: DeferredRotary | None = None
        #: Whether the stock processor's Diffusers ``RMSNorm`` calls run as our one launch (``serving.qk_norm``).
        self.fused_qk_norm = False
        #: The module's keyword rule for the stock processor (``serving.keywords``; None: it passes every keyword).
        self.keywords: KeywordFilter | None = None
        #: The stock processor is an IP-Adapter's: its attention calls after the first attend to the image prompt.
        self.image_prompt = False
        #: The stock processor stays the module's processor, served by hooks on the module (``serving.ip_adapter``).
        self.in_place = False
        self._settings: "Settings | None" = None
        self.key = intercept.register_layer(self)

    def unregister(self) -> None:
        """Stop serving: the op no longer finds this state (its records stay readable)."""
        intercept.unregister_layer(self.key)

    # ---- copies and pickling: a copy is registered on its own ---------------------------------
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("key", "_settings")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._settings = None
        self.key = intercept.register_layer(self)
        if self.stock is not None and self.mode is not None:
            intercept.ensure_routing(self.stock)
        if self.fused_qk_norm:
            fuse_rms_norm()
        self.processor._adopt(self)

    # ---- description --------------------------------------------------------------------------
    @property
    def label(self) -> str:
        return self.name or f"<{self.role} attention #{int(self.key)}>"

    @property
    def records(self) -> list[StepRecord]:
        """This run's per-step records (bounded, see ``stats``)."""
        return self.stats.records

    def __repr__(self) -> str:
        return f"LayerState({self.label!r}, role={self.role!r}, mode={self.mode!r}, steps={len(self.stats)})"

    # ---- binding ------------------------------------------------------------------------------
    def set_stock(self, stock: Any, module: torch.nn.Module, in_place: bool = False) -> None:
        """Adopt ``stock`` as the family processor that does everything but the attention call; ``in_place``: it stays
        the module's processor, and the module's forward names this layer (``serving.ip_adapter``)."""
        self.stock = stock
        self.in_place = in_place
        self.mode, self.reason = (None, "no stock processor is known") if stock is None else intercept.serving_mode(stock)
        self.rotary = None
        self.fused_qk_norm = False
        self.keywords = None if stock is None or in_place else keyword_filter(type(module), type(stock))
        self.image_prompt = intercept.is_ip_adapter(stock)
        self.module_is_cross = getattr(module, "is_cross_attention", None)
        if not self.role_observed:
            self.role = guess_role(self.name, module)
        if self.mode is None:
            warn_once(("unserved", type(stock).__name__), "TrtllmAttnProcessor: %s keeps its stock attention: %s.",
                      self.label, self.reason)
            return
        intercept.ensure_routing(stock)
        if in_place:  # the hooks see the module's forward arguments
            params = list(inspect.signature(type(module).forward).parameters)[1:]  # after self
        else:
            params = list(inspect.signature(type(stock).__call__).parameters)[2:]  # after self, attn
        self.mask_params = tuple((i, p) for i, p in enumerate(params) if "mask" in p)
        self.hidden_index = params.index("hidden_states") if "hidden_states" in params else (0 if params else None)
        self.encoder_index = params.index("encoder_hidden_states") if "encoder_hidden_states" in params else None
        self.rotary = deferred_rotary(stock, params) if self.processor._fused_rotary and not in_place else None
        self.fused_qk_norm = self.processor._fused_qk_norm and takes_norms_of(module)

    def take_over(self, previous: "LayerState") -> None:
        """Carry what belongs to the module, not to a processor, from the state that served it until now:
        its name, role, stock processor, timestep tracker and calibration (the records stay behind)."""
        for attr in ("name", "role", "role_observed", "stock", "unfused_stock", "reason", "tracker", "calibration",
                     "ignored", "in_place"):
            setattr(self, attr, getattr(previous, attr))
        self.refresh()

    def rename(self, name: str, module: torch.nn.Module) -> None:
        self.name = name
        if not self.role_observed:
            self.role = guess_role(name, module)
        self.refresh()

    def settings(self) -> "Settings":
        if self._settings is None:
            self._settings = self.processor._settings_for(self)
        return self._settings

    @property
    def needs_calibration(self) -> bool:
        """Whether this layer asks for ``target_sparsity`` and no calibration curve (nor ``ignore``) backs it."""
        return self.settings().skip.target_sparsity is not None and self.calibration is None and not self.ignored

    def refresh(self) -> None:
        """Forget cached settings after the processor, role or calibration changed."""
        self._settings = None
        _changed()

    # ---- serving one call (inside the custom op) ---------------------------------------------
    def serve(self, query, key, value, attn_mask, mask_source, timestep, scale, hidden_len: int, encoder_len: int,
              via_sdpa: bool) -> torch.Tensor:
        """Our attention for one intercepted call, ``[B, S, H, D]`` in and out."""
        return self._serve(query, key, value, attn_mask, mask_source, timestep, scale, hidden_len, encoder_len,
                           via_sdpa, 0)[0]

    def serve_kv_shard(self, query, key, value, timestep, scale, hidden_len: int, encoder_len: int,
                       kv_shards: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Ring attention: ``[B, S, H, D]`` output over one of ``kv_shards`` KV shards, and its ``[B, S, H]``
        float32 log-sum-exp, which Diffusers merges shards by. Unmasked (masks keep the stock path)."""
        return self._serve(query, key, value, None, None, timestep, scale, hidden_len, encoder_len, False, kv_shards)

    def _stock_or_fail(self, kv_shards: int, why: str, query, key, value, attn_mask, scale, via_sdpa):
        """The stock path of a call we do not run; a ring shard cannot take it (no log-sum-exp from it)."""
        if kv_shards:
            raise RuntimeError(f"diffusers_trtllm: {self.label} cannot serve a ring-attention KV shard: {why}; "
                               "run this layer without ring attention (ContextParallelConfig(ulysses_degree=n)).")
        return intercept.stock_attention(self, query, key, value, attn_mask, scale, via_sdpa), None

    def _serve(self, query, key, value, attn_mask, mask_source, timestep, scale, hidden_len: int, encoder_len: int,
               via_sdpa: bool, kv_shards: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``serve``'s work; ``kv_shards > 0``: a ring shard, also returning the log-sum-exp."""
        if not self.role_observed:
            self.role = observed_role(self.role, self.module_is_cross, query.shape[1], key.shape[1], hidden_len,
                                      encoder_len)
            self.role_observed = True
            self.refresh()
        settings = self.settings()
        stock = (query, key, value, attn_mask, scale, via_sdpa)
        if settings.mode == "stock":
            return self._stock_or_fail(kv_shards, f"its role {self.role!r} is set to 'stock'", *stock)
        t = self._timestep(timestep)
        if query.shape[1] == 0 or key.shape[1] == 0:
            self._record(t, "stock")
            return self._stock_or_fail(kv_shards, "it has no queries or keys", *stock)
        try:
            plan = self._plan(query, key, attn_mask, mask_source)
        except MaskNotSupportedError as err:
            warn_once(("stock-mask", self.role, type(self.stock).__name__),
                      "TrtllmAttnProcessor: %s attention (%s) keeps its stock path: %s", self.role, self.label, err)
            self._record(t, "stock")
            return self._stock_or_fail(kv_shards, str(err), *stock)
        trtllm = settings.mode == "trtllm"
        # Skip-softmax not configured runs as no skip at all: None (the call's plan key then hashes no config).
        skip = settings.skip if trtllm and settings.skip.configured else None
        quant = settings.quant if trtllm else None
        if skip is not None and skip.gated and t is None:
            skip = self._ungated_skip(skip)
        observer = self.processor._call_observer
        if observer is not None:  # calibrate(): sees every call's Q, K and layout
            observer(self, t, plan.layout or build_layout(query, key, None, self.processor._layouts), query, key, scale)
        # run_attention on [B, S, H, D], by position (issue 57): attn_mask, layout, softmax_scale, skip, quant,
        # timestep, backend, fallback, role, collect_stats, layout_cache, policy, honour, return_lse, kv_shards, stock
        out, result = _run_nhd(
            query, key, value, None, plan.layout, scale, skip, quant, t, settings.backend, settings.fallback, self.role,
            self.processor.collect_stats, self.processor._layouts, settings.policy, settings.honour, kv_shards > 0,
            max(kv_shards, 1),
            None if plan.padded else lambda: intercept.stock_attention(self, *stock),
        )
        if plan.padded:
            out = self._stock_rows(out, plan, query, key, value, attn_mask, scale, via_sdpa)
        self._record(t, result.route, result.sparse, result.sage, result.skipped_tiles, result.total_tiles, result.note)
        return out, result.lse

    def _ungated_skip(self, skip: SkipSoftmaxConfig) -> SkipSoftmaxConfig | None:
        """Gated skip-softmax with no known t: say why once, then run dense (never a stale t)."""
        if self.processor._step_callback_attached:
            info_once(("first-step-dense", id(self.processor)),
                      "DenoiseStepCallback publishes t after each step, so the first step runs dense; "
                      "attach_denoise_tracking(pipe, proc) knows t before every step.")
            return None
        if self.tracker is not None and self.tracker.detached:
            warn_once(("detached", id(self.tracker)),
                      "TrtllmAttnProcessor: denoise tracking was detached, so no timestep is known and gated "
                      "skip-softmax runs dense (attention role %r); attach_denoise_tracking(pipe) again to gate it.",
                      self.role)
            return None
        return skip  # resolve_skip_factor warns once and runs dense

    def _timestep(self, tensor: torch.Tensor | None) -> float | None:
        if self.tracker is None:
            return self.processor._fallback_timestep
        t = self.tracker.read(tensor)
        return t if t is not None or self.tracker.timed else self.processor._fallback_timestep

    def _plan(self, query, key, attn_mask, mask_source) -> _MaskPlan:
        """The layout of a masked call (cached per mask, so one sync per forward); an unmasked call's is
        ``run_attention``'s, kept in its plan (no lookup here: issue 57)."""
        if attn_mask is None:
            return _UNMASKED
        batch, q_len, kv_len = query.shape[0], query.shape[1], key.shape[1]
        cache = self.processor._layouts

        def build() -> _MaskPlan:
            try:
                return _MaskPlan(build_layout(query, key, attn_mask))
            except MaskNotSupportedError:
                q_mask, kv_mask = query_key_masks(attn_mask, batch, q_len, kv_len)  # raises if not separable
                layout = (cache.dense(batch, q_len, kv_len, query.device) if bool(kv_mask.all())
                          else PackedLayout.from_masks(batch, q_len, kv_len, kv_mask=kv_mask))
                padded = tuple(torch.nonzero(~row).reshape(-1) if not bool(row.all()) else None for row in q_mask)
                return _MaskPlan(layout, padded)

        # Families build their mask from ``mask_source`` afresh in every layer (Qwen-Image, LTX):
        # key the cache on the source so one forward pays one sync.
        source = attn_mask if mask_source is None else mask_source
        extra = (batch, q_len, kv_len, tuple(attn_mask.shape), attn_mask.dtype, type(self.stock))
        return cache.get(source, extra, build)

    def _stock_rows(self, out, plan: _MaskPlan, query, key, value, attn_mask, scale, via_sdpa) -> torch.Tensor:
        """Padded queries of an outer-product mask get exactly the stock kernel's rows."""
        out = out.clone()
        mask = attn_mask if attn_mask.ndim == 4 else attn_mask.reshape((1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape))
        for b, rows in enumerate(plan.padded):
            if rows is None:
                continue
            m = mask[b if mask.shape[0] > 1 else 0][None]
            m = m[:, :, rows] if m.shape[2] > 1 else m
            out[b, rows] = intercept.stock_attention(
                self, query[b:b + 1, rows], key[b:b + 1], value[b:b + 1], m, scale, via_sdpa)[0]
        return out

    def record_stock(self, why: str) -> None:
        """Count a call that never reached our op (autograd on, a causal call, ...) as ``stock``, saying why."""
        tensor = self.tracker.tensor if self.tracker is not None else None
        self._record(self._timestep(tensor), "stock", note=why)

    def _record(self, t: float | None, route: str, sparse: bool = False, sage: bool = False,
                skipped_tiles: int | None = None, total_tiles: int | None = None, note: str | None = None) -> None:
        tracker = self.tracker
        if tracker is None:
            run = step = None
        else:
            step = tracker.count_call()  # (first: it may start a new run)
            run = tracker.run
        self.calls += 1
        self.stats.add(run, step, t, route, sparse, sage, skipped_tiles, total_tiles, note)
