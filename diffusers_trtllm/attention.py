"""Functional entry point: pack, resolve skip-softmax and SAGE, pick a route, run, unpack."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch

from ._logging import warn_once
from .config import DEFAULT_K_BLOCK, ControlTypeError, QuantConfig, SkipSoftmaxConfig
from .layout import LayoutCache, PackedLayout, _bounded_put, key_padding_mask
from .routing import AttentionCall, AttentionResult, NoRouteError, get_route, select_route
from .routing.registry import Route, registry_epoch
from .routing.policy import apply_policy

__all__ = ["attention", "run_attention", "check_tensors", "check_tensor_layout", "resolve_skip_factor", "resolve_quant",
           "build_layout", "check_route_choice", "TENSOR_LAYOUTS"]

FALLBACKS = (None, "dense")
#: ``tensor_layout`` names (SageAttention's): the order of Q, K, V's (and the output's) dimensions.
TENSOR_LAYOUTS = {"NHD": "[batch, tokens, heads, head_dim]", "HND": "[batch, heads, tokens, head_dim]"}
#: The step table's note on a dense call that ran the caller's own SDPA call (``run_attention``'s ``stock``).
STOCK_SDPA_NOTE = "dense on the family's own SDPA call"


def check_route_choice(backend: str, fallback: str | None, where: str = "") -> None:
    """Reject an unknown ``backend`` or ``fallback`` before any work; ``where`` names the setting's owner."""
    if not isinstance(backend, str):
        raise ControlTypeError(f"backend must be a route name or 'auto'; got {backend!r} ({type(backend).__name__}){where}.")
    if backend != "auto":
        try:
            get_route(backend)
        except ValueError as err:
            raise ValueError(f"{str(err).rstrip('.')}{where}.") from None
    if not (fallback is None or isinstance(fallback, str)) or fallback not in FALLBACKS:
        raise ValueError(f"fallback must be None or 'dense'; got {fallback!r}{where}.")


def resolve_skip_factor(
    skip: SkipSoftmaxConfig | None, max_seqlen_kv: int, timestep: float | None, role: str = "self", kv_shards: int = 1
) -> float | None:
    """The kernel's scale factor for this call, or None to run dense (gated, or not configured).

    ``kv_shards``: the keys are one of that many equal shards (ring attention); ``lambda`` is then
    the whole sequence's (``factor / (kv_shards * shard_len)``), as on one process.
    """
    if skip is None or not skip.configured:
        return None
    if skip.gated and timestep is None:
        warn_once(
            ("no-timestep",),
            "skip-softmax: disabled_until_timestep=%s is set but no denoising timestep is known (first seen on "
            "attention role %r), so attention stays dense. Install the processor on the transformer "
            "(transformer.set_attn_processor(proc) or install(pipe, proc): its timestep is read every step), or "
            "publish t yourself: proc.set_timestep(t) or attach_denoise_tracking(pipe, proc) in a custom loop.",
            skip.disabled_until_timestep,
            role,
        )
        return None
    if not skip.active_at(timestep):
        return None
    return skip.scale_factor(max_seqlen_kv * kv_shards) / kv_shards


def resolve_quant(quant: QuantConfig | None, layout: PackedLayout, role: str = "self") -> QuantConfig | None:
    """SAGE settings for this call: None when off, or when a KV sequence is shorter than a K block."""
    if quant is None or not quant.enabled:
        return None
    block = quant.with_k_block(DEFAULT_K_BLOCK).k_block_size  # (a route's own block may be larger: partial is fine)
    if layout.min_seqlen_kv < block:
        warn_once(
            ("sage-short-kv", role, block),
            "SAGE quantization is configured for attention role %r, but a KV sequence has %d tokens, fewer "
            "than k_block_size=%d; that attention runs unquantized.",
            role,
            layout.min_seqlen_kv,
            block,
        )
        return None
    return quant


def build_layout(
    query: torch.Tensor, key: torch.Tensor, attn_mask: torch.Tensor | None, cache: LayoutCache | None = None
) -> PackedLayout:
    """Layout of ``[batch, tokens, heads, dim]`` inputs under an optional key-padding mask; ``cache`` keeps one per
    mask object, and one per shape of unmasked inputs."""
    batch, q_len = query.shape[:2]
    kv_len = key.shape[1]
    if attn_mask is None:
        return PackedLayout.dense(batch, q_len, kv_len, query.device) if cache is None else cache.dense(
            batch, q_len, kv_len, query.device)

    def build() -> PackedLayout:
        kv_mask = key_padding_mask(attn_mask, batch, q_len, kv_len)
        if bool(kv_mask.all()):
            return PackedLayout.dense(batch, q_len, kv_len, query.device)
        return PackedLayout.from_masks(batch, q_len, kv_len, kv_mask=kv_mask)

    if cache is None:
        return build()
    return cache.get(attn_mask, (batch, q_len, kv_len), build)


def _check_layout(layout: PackedLayout, query: torch.Tensor, key: torch.Tensor) -> None:
    """A caller's layout must describe these tensors: same device, same (flattened) token counts."""
    if layout.cu_seqlens_q.device != query.device:
        raise ValueError(
            f"layout metadata is on {layout.cu_seqlens_q.device} but query is on {query.device}; "
            "build the cu_seqlens on the Q/K device."
        )
    for name, x, expected in (("query", query, layout.batch * layout.q_len), ("key", key, layout.batch * layout.kv_len)):
        if x.shape[0] * x.shape[1] != expected:
            raise ValueError(
                f"layout describes {expected} {name} token slots (batch {layout.batch} x {expected // layout.batch}) "
                f"but {name} holds {x.shape[0]} x {x.shape[1]}; pass a packed [1, tokens, heads, dim] tensor "
                "matching the layout's cu_seqlens."
            )


def check_tensor_layout(tensor_layout: Any) -> None:
    """``tensor_layout`` must name one of :data:`TENSOR_LAYOUTS`."""
    if not isinstance(tensor_layout, str) or tensor_layout not in TENSOR_LAYOUTS:
        error = ValueError if isinstance(tensor_layout, str) else ControlTypeError
        raise error(f"tensor_layout must be 'NHD' ({TENSOR_LAYOUTS['NHD']}) or 'HND' ({TENSOR_LAYOUTS['HND']}, "
                    f"SDPA's and sageattn's); got {tensor_layout!r:.60}.")


def check_tensors(query: Any, key: Any, value: Any, tensor_layout: str = "NHD") -> None:
    """Q, K, V must be 4-d tensors of one floating dtype on one device that agree in ``tensor_layout``."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise ControlTypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}.")
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(
            f"query, key and value must be {TENSOR_LAYOUTS[tensor_layout]} (tensor_layout={tensor_layout!r}); got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}."
        )
    if tensor_layout == "HND":
        query, key, value = (x.transpose(1, 2) for x in (query, key, value))
    if not (query.dtype == key.dtype == value.dtype) or not query.is_floating_point():
        raise ValueError(
            f"query, key and value must share one floating dtype (float16, bfloat16 or float32); got "
            f"{query.dtype}, {key.dtype}, {value.dtype}. Cast them to one dtype first."
        )
    if not (query.device == key.device == value.device):
        raise ValueError(f"query, key and value must be on one device; got {query.device}, {key.device}, {value.device}.")
    if key.shape[:3] != value.shape[:3] or query.shape[0] != key.shape[0] or query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query, key and value of shapes {_shapes(tensor_layout, query, key, value)} do not agree in "
            f"{TENSOR_LAYOUTS[tensor_layout]} (same batch; key and value same tokens and heads; query and key same "
            "head_dim)."
        )
    if query.shape[2] % key.shape[2]:
        raise ValueError(f"query heads ({query.shape[2]}) must be a multiple of key heads ({key.shape[2]}).")


def _shapes(tensor_layout: str, *tensors: torch.Tensor) -> str:
    """The tensors' shapes as the caller passed them (``check_tensors`` reads ``HND`` ones transposed)."""
    return ", ".join(str(tuple(x.transpose(1, 2).shape if tensor_layout == "HND" else x.shape)) for x in tensors)


def _check_scalars(softmax_scale: Any, timestep: Any) -> None:
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise ControlTypeError(f"softmax_scale must be a number or None; got {softmax_scale!r} ({type(softmax_scale).__name__}).")
        if not (math.isfinite(softmax_scale) and softmax_scale > 0):
            raise ValueError(f"softmax_scale must be finite and > 0 (None: 1/sqrt(head_dim)); got {softmax_scale!r}.")
    if timestep is not None:
        if isinstance(timestep, bool) or not isinstance(timestep, (int, float)):
            raise ControlTypeError(f"timestep must be a number in [0, 1] or None; got {timestep!r} ({type(timestep).__name__}).")
        if not 0.0 <= timestep <= 1.0:
            raise ValueError(f"timestep must be the normalized denoising timestep in [0, 1]; got {timestep!r}.")


def run_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    tensor_layout: str = "NHD",
    attn_mask: torch.Tensor | None = None,
    layout: PackedLayout | None = None,
    softmax_scale: float | None = None,
    skip: SkipSoftmaxConfig | Mapping[str, Any] | float | None = None,
    quant: QuantConfig | Mapping[str, Any] | str | None = None,
    timestep: float | None = None,
    backend: str = "auto",
    fallback: str | None = None,
    role: str = "self",
    collect_stats: bool = False,
    layout_cache: LayoutCache | None = None,
    policy: str = "auto",
    honour: Collection[str] = (),
    return_lse: bool = False,
    kv_shards: int = 1,
    stock: Callable[[], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, AttentionResult]:
    """Attention over ``[batch, tokens, heads, dim]`` tensors (``tensor_layout="NHD"``) or ``[batch, heads, tokens,
    dim]`` ones (``"HND"``, SDPA's and ``sageattn``'s); returns the output, in the same layout, and the route's result.

    ``policy="auto"`` runs dense where skip-softmax or SAGE cannot pay off on this call
    (``routing.policy.apply_policy``: measured rules, CUDA only); ``"always"`` honours the request, and
    ``honour`` keeps the named features (``"skip"``, ``"sage"``) whatever the rules say.
    ``skip`` and ``quant`` take every form ``SkipSoftmaxConfig.coerce`` / ``QuantConfig.coerce``
    accept (a threshold or a dict; a dtype name or a dict).
    ``return_lse``: the result also carries each query row's log-sum-exp, ``result.lse``
    ``[batch, q_tokens, heads]`` float32 (only routes that return it can serve the call);
    ``kv_shards``: the keys are one of that many equal KV shards of the sequence (ring attention).
    ``stock``: the caller's own attention for these inputs (the processor's: the family's stock call). A dense
    call that would run on ``sdpa`` runs it instead, so where no faster dense kernel can run (no FlashInfer
    JIT) the call is exactly what stock Diffusers makes, never slower; it returns the output in ``tensor_layout``.
    ``attn_mask`` and ``layout`` do not depend on ``tensor_layout``; ``result.lse`` follows it (``[batch, heads,
    q_tokens]`` for ``"HND"``).
    """
    return _run(query, key, value, tensor_layout, attn_mask, layout, softmax_scale, skip, quant, timestep, backend,
                fallback, role, collect_stats, layout_cache, policy, honour, return_lse, kv_shards, stock)


def _run(query, key, value, tensor_layout, attn_mask, layout, softmax_scale, skip, quant, timestep, backend, fallback,
         role, collect_stats, layout_cache, policy, honour, return_lse,
         kv_shards, stock) -> tuple[torch.Tensor, AttentionResult]:
    """``run_attention``'s work, its arguments by position: a call by a dozen keywords costs about 0.5 us of CPU
    more (issue 57)."""
    check_tensor_layout(tensor_layout)
    if tensor_layout == "HND":  # checked as passed (errors name the caller's shapes), then run as NHD views
        check_tensors(query, key, value, tensor_layout)
        query, key, value = (x.transpose(1, 2) for x in (query, key, value))
    out, result = _run_nhd(query, key, value, attn_mask, layout, softmax_scale, skip, quant, timestep, backend, fallback,
                           role, collect_stats, layout_cache, policy, honour, return_lse, kv_shards, stock)
    if tensor_layout == "HND":
        out = out.transpose(1, 2)
        if result.lse is not None:
            result.lse = result.lse.transpose(1, 2)
    return out, result


def _run_nhd(query, key, value, attn_mask, layout, softmax_scale, skip, quant, timestep, backend, fallback, role,
             collect_stats, layout_cache, policy, honour, return_lse, kv_shards,
             stock) -> tuple[torch.Tensor, AttentionResult]:
    """``run_attention`` on ``[batch, tokens, heads, dim]`` tensors: a call of known shapes and settings reuses its
    plan (``_PLANS``), any other is decided afresh."""
    # The usual call passes no scale, timestep nor skip-softmax: nothing to check, coerce or resolve (the calls
    # skipped cost ~0.2 us; issue 57).
    if softmax_scale is not None or timestep is not None:
        _check_scalars(softmax_scale, timestep)
    if skip is not None:
        skip = SkipSoftmaxConfig.coerce(skip)
    plain = attn_mask is None and type(query) is type(key) is type(value) is torch.Tensor
    if plain and len(key_shape := key.shape) == 4:
        kv_len = layout.max_seqlen_kv if layout is not None else key_shape[1]
        factor = None if skip is None else resolve_skip_factor(skip, kv_len, timestep, role, kv_shards)
        try:
            plan_key = (query.shape, key_shape, value.shape, query.dtype, key.dtype, value.dtype, query.device,
                        key.device, value.device, id(layout), softmax_scale, skip, quant, factor is None, backend,
                        fallback, role, collect_stats, policy, frozenset(honour), return_lse, kv_shards, stock is None,
                        registry_epoch())
            plan = _PLANS.get(plan_key)
        except TypeError:  # an unhashable setting (a dict): decided afresh
            plan_key = plan = None
        if plan is None or (layout is not None and plan.layout is not layout):
            plan = _decide(query, key, value, None, layout, softmax_scale, skip, factor, quant, backend, fallback,
                           role, collect_stats, policy, honour, return_lse, kv_shards, stock is not None, layout_cache)
            if plan_key is not None:
                _bounded_put(_PLANS, plan_key, plan, _PLANS_MAX)
        return _execute(plan, query, key, value, factor, stock)
    if layout is not None and attn_mask is not None:
        raise ValueError("pass attn_mask or layout, not both.")
    if layout is None:
        check_tensors(query, key, value)
        layout = build_layout(query, key, attn_mask, layout_cache)
    factor = resolve_skip_factor(skip, layout.max_seqlen_kv, timestep, role, kv_shards)
    plan = _decide(query, key, value, attn_mask, layout, softmax_scale, skip, factor, quant, backend, fallback, role,
                   collect_stats, policy, honour, return_lse, kv_shards, stock is not None, layout_cache)
    return _execute(plan, query, key, value, factor, stock)


#: What a call's settings and shapes decide (``_decide``), by everything that decision reads but the tensors'
#: values: an unmasked call of a known shape and settings skips the checks, the layout, the policy and the route's
#: choice, all pure functions of those (a route registered later changes ``registry_epoch``).
_PLANS: dict[tuple, "_Plan"] = {}
_PLANS_MAX = 1024


@dataclass(frozen=True)
class _Plan:
    """A decided call: its layout, whether skip-softmax and SAGE stay on (what the policy kept of the request),
    the route that runs it (None: the caller's stock call), the policy's note, and its ``AttentionCall``'s
    fields but the tensors and the skip factor (``AttentionCall.fixed_fields``)."""

    layout: PackedLayout
    skip: bool
    sage: bool
    route: Route | None
    note: str | None
    fixed: Mapping[str, Any]


def _decide(query, key, value, attn_mask, layout, softmax_scale, skip, factor, quant, backend, fallback, role,
            collect_stats, policy, honour, return_lse, kv_shards, has_stock, layout_cache) -> _Plan:
    """Check the call, and choose its layout, what the policy keeps of the request and the route (``run_attention``)."""
    check_route_choice(backend, fallback)
    check_tensors(query, key, value)
    quant = QuantConfig.coerce(quant)
    if layout is None:
        layout = build_layout(query, key, attn_mask, layout_cache)
    else:
        _check_layout(layout, query, key)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
    q, k, v = layout.pack(query, key, value)
    call = AttentionCall(
        q=q,
        k=k,
        v=v,
        layout=layout,
        softmax_scale=scale,
        skip_factor=factor,
        quant=resolve_quant(quant, layout, role),
        collect_stats=collect_stats,
        role=role,
        return_lse=return_lse,
        kv_shards=kv_shards,
    )
    decision = apply_policy(call, policy, honour, skip.target_sparsity if skip is not None else None, backend)
    call = decision.call
    try:
        route = select_route(call, backend)
    except NoRouteError as err:
        if fallback != "dense" or (call.skip_factor is None and call.quant is None):
            raise
        dense = replace(call, skip_factor=None, quant=None)
        route = select_route(dense, backend)
        dropped = ", ".join(
            name for name, on in (("skip-softmax", call.skip_factor is not None), ("SAGE", call.quant is not None)) if on
        )
        warn_once(
            ("fallback-dense", dropped, route.name),
            "fallback='dense': attention runs dense on route %r without %s (first seen on attention role %r); "
            "no route runs them here: %s.",
            route.name,
            dropped,
            role,
            _why_not(err),
        )
        call = dense
    dense_call = call.skip_factor is None and call.quant is None
    stock = route.name == "sdpa" and has_stock and dense_call and not return_lse
    return _Plan(layout, call.skip_factor is not None, call.quant is not None, None if stock else route,
                 decision.note or (STOCK_SDPA_NOTE if stock else None), call.fixed_fields())


def _execute(plan: _Plan, query, key, value, factor: float | None,
             stock: Callable[[], torch.Tensor] | None) -> tuple[torch.Tensor, AttentionResult]:
    """Run a decided call on these tensors (``factor``: this call's skip factor, where the plan keeps skip)."""
    if plan.route is None:
        out = stock()
        return out, AttentionResult(out, "sdpa", note=plan.note)
    layout = plan.layout
    q, k, v = layout.pack(query, key, value)
    result = plan.route.run(AttentionCall.assemble(plan.fixed, q, k, v, factor if plan.skip else None))
    result.sparse, result.sage, result.note = plan.skip, plan.sage, plan.note
    if result.lse is not None:
        result.lse = layout.unpack_q(result.lse[..., None])[..., 0]
    return layout.unpack_q(result.out), result


def _why_not(err: NoRouteError) -> str:
    """One line: why the routes that offer the dropped features cannot serve the call."""
    lacking = ("no skip-softmax", "no SAGE")
    offering = {name: r for name, r in err.reasons.items() if r and not any(x.startswith(lacking) for x in r)}
    return "; ".join(f"{name}: {r[0]}" for name, r in offering.items()) or "no route offers it"


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    tensor_layout: str = "NHD",
    attn_mask: torch.Tensor | None = None,
    layout: PackedLayout | None = None,
    softmax_scale: float | None = None,
    skip: SkipSoftmaxConfig | Mapping[str, Any] | float | None = None,
    quant: QuantConfig | Mapping[str, Any] | str | None = None,
    timestep: float | None = None,
    backend: str = "auto",
    fallback: str | None = None,
    collect_stats: bool = False,
    policy: str = "auto",
) -> torch.Tensor:
    """Attention of ``query``, ``key``, ``value`` in ``tensor_layout`` (``"NHD"``: ``[batch, tokens, heads, head_dim]``;
    ``"HND"``: ``[batch, heads, tokens, head_dim]``, SDPA's and ``sageattn``'s); the output is in the same layout.
    The other keywords are :func:`run_attention`'s, which also returns the route's result."""
    # run_attention(...)[0], by position (its defaults: role "self", no layout cache, honour nothing, no
    # log-sum-exp, one KV shard, no stock call)
    return _run(query, key, value, tensor_layout, attn_mask, layout, softmax_scale, skip, quant, timestep, backend,
                fallback, "self", collect_stats, None, policy, (), False, 1, None)[0]
