"""Routing a Diffusers family's core attention call to our kernels, keeping everything else stock.

Each family's own processor (projections, QK norm, RoPE, text concatenation) keeps
running; only the attention call inside it is redirected, in one of two ways:

- ``dispatch``: the processor calls ``dispatch_attention_fn(..., backend=self._attention_backend)``
  (Flux, Flux2, Wan, LTX, Qwen-Image, HunyuanVideo, and most AttentionModuleMixin
  families). The stock processor gets a :class:`LayerBackend` of ours as its
  ``_attention_backend`` and the family module's global ``dispatch_attention_fn``
  is rebound to a function that sends calls carrying a ``LayerBackend`` to our
  custom op and everything else to the original.
- ``sdpa``: the processor calls ``F.scaled_dot_product_attention`` itself (SD3,
  CogVideoX, plain ``AttnProcessor2_0`` such as HunyuanVideo's token refiner). The
  module's global ``F`` is rebound to a copy of ``torch.nn.functional`` whose
  ``scaled_dot_product_attention`` routes only while one of our layers is running
  (``CURRENT_CALL.state``); otherwise it is torch's own.

Both end in one ``torch.library.custom_op`` that looks the layer up by an int id,
so ``torch.compile`` sees an opaque op and no graph break (a ``TorchFunctionMode``
costs 11 breaks). Calls we cannot serve (dropout, causal, context parallelism,
autograd) take the stock path unchanged.
"""

from __future__ import annotations

import sys
import types
import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as torch_F

__all__ = ["LayerBackend", "CURRENT_CALL", "serving_mode", "install_routing", "register_layer", "stock_sdpa"]

#: Layer id -> per-layer state (the object stored on the attention module); ``serve`` runs the call.
_LAYERS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_next_id = 0


def register_layer(state: Any) -> int:
    """A fresh int id under which the custom op finds ``state``."""
    global _next_id
    _next_id += 1
    _LAYERS[_next_id] = state
    return _next_id


class LayerBackend:
    """Stands in a stock processor's ``_attention_backend`` slot and names the layer it serves."""

    def __init__(self, state: Any, stock_backend: Any) -> None:
        self.state = state
        #: What the processor had there before (None: Diffusers' active backend), used on the stock path.
        self.stock_backend = stock_backend

    def __repr__(self) -> str:
        return f"LayerBackend(trtllm, layer={self.state.layer_id})"


class _CurrentCall:
    """What our processor knows about the call in flight (set around the stock processor's call).

    A module-level object with plain attributes: ``torch.compile`` traces the stores
    and loads as side effects, without graph breaks.
    """

    state: Any = None
    mask_source: Optional[torch.Tensor] = None
    timestep: Optional[torch.Tensor] = None


CURRENT_CALL = _CurrentCall()


@torch.library.custom_op("diffusers_trtllm::attention", mutates_args=())
def _attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    mask_source: Optional[torch.Tensor],
    timestep: Optional[torch.Tensor],
    layer_id: int,
    scale: Optional[float],
) -> torch.Tensor:
    """``[B, S, H, D]`` attention of layer ``layer_id`` (opaque to ``torch.compile``)."""
    return _LAYERS[layer_id].serve(query, key, value, attn_mask, mask_source, timestep, scale)


@_attention_op.register_fake
def _attention_fake(query, key, value, attn_mask, mask_source, timestep, layer_id, scale):
    return query.new_empty(*query.shape[:-1], value.shape[-1])


def _servable(dropout_p: float, is_causal: bool, query: torch.Tensor, extra: Any = None) -> bool:
    """Inference-only, non-causal, no dropout, no context parallelism: everything else stays stock."""
    return (
        not dropout_p
        and not is_causal
        and not extra
        and not (torch.is_grad_enabled() and query.requires_grad)
    )


def _make_routed_dispatch(original: Callable) -> Callable:
    def dispatch_attention_fn(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: Optional[float] = None,
        enable_gqa: bool = False,
        attention_kwargs: Optional[dict] = None,
        *,
        backend: Any = None,
        parallel_config: Any = None,
    ) -> torch.Tensor:
        if isinstance(backend, LayerBackend):
            if _servable(dropout_p, is_causal, query, attention_kwargs or parallel_config):
                call = CURRENT_CALL
                return torch.ops.diffusers_trtllm.attention(
                    query, key, value, attn_mask, call.mask_source, call.timestep, backend.state.layer_id, scale
                )
            backend = backend.stock_backend
        return original(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, attention_kwargs,
            backend=backend, parallel_config=parallel_config,
        )

    dispatch_attention_fn._trtllm_original = original  # type: ignore[attr-defined]
    return dispatch_attention_fn


def _routed_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` (``[B, H, S, D]``) that routes while one of our layers runs."""
    state = CURRENT_CALL.state
    if state is not None and state.mode == "sdpa" and _servable(dropout_p, is_causal, query):
        out = torch.ops.diffusers_trtllm.attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask,
            CURRENT_CALL.mask_source, CURRENT_CALL.timestep, state.layer_id, scale,
        )
        return out.transpose(1, 2)
    return torch_F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )


def stock_sdpa(query, key, value, attn_mask, scale):
    """The stock path of an ``sdpa``-mode layer, on ``[B, S, H, D]`` tensors."""
    out = torch_F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attn_mask, scale=scale,
        enable_gqa=key.shape[2] != query.shape[2],
    )
    return out.transpose(1, 2)


#: ``torch.nn.functional`` with a routing ``scaled_dot_product_attention``.
_F_PROXY = types.ModuleType("diffusers_trtllm.functional", "torch.nn.functional with routed SDPA")
_F_PROXY.__dict__.update({k: v for k, v in vars(torch_F).items() if not k.startswith("__")})
_F_PROXY.scaled_dot_product_attention = _routed_sdpa


def _call_names(stock: Any) -> set[str]:
    """Global names the stock processor's ``__call__`` refers to."""
    fn = getattr(type(stock), "__call__", None)
    code = getattr(fn, "__code__", None)
    return set(code.co_names) if code is not None else set()


def serving_mode(stock: Any) -> tuple[str | None, str]:
    """How a stock processor's attention call can be routed: ``("dispatch"|"sdpa"|None, reason)``."""
    module = sys.modules.get(type(stock).__module__)
    names = _call_names(stock)
    if module is None:
        return None, f"its module {type(stock).__module__!r} is not loaded"
    if "dispatch_attention_fn" in names and hasattr(module, "dispatch_attention_fn"):
        return "dispatch", ""
    if "scaled_dot_product_attention" in names and getattr(module, "F", None) in (torch_F, _F_PROXY):
        return "sdpa", ""
    if hasattr(module, "dispatch_attention_fn") and hasattr(stock, "_attention_backend"):
        # The call sits in a helper of the same module (e.g. Flux2's KV-cache helpers).
        return "dispatch", ""
    return None, f"{type(stock).__name__} calls neither dispatch_attention_fn nor F.scaled_dot_product_attention"


def install_routing(stock: Any, mode: str) -> None:
    """Rebind the stock processor's module global (once per module) so its attention call routes."""
    module = sys.modules[type(stock).__module__]
    if mode == "dispatch":
        current = module.dispatch_attention_fn
        if not hasattr(current, "_trtllm_original"):
            module.dispatch_attention_fn = _make_routed_dispatch(current)
    elif mode == "sdpa":
        if module.F is torch_F:
            module.F = _F_PROXY
    else:
        raise ValueError(f"unknown serving mode {mode!r}; expected 'dispatch' or 'sdpa'.")


def original_dispatch(stock: Any) -> Callable:
    """The Diffusers ``dispatch_attention_fn`` behind our rebinding, for the stock path."""
    fn = sys.modules[type(stock).__module__].dispatch_attention_fn
    return getattr(fn, "_trtllm_original", fn)


def infer_role(name: str | None, module: torch.nn.Module, stock: Any) -> str:
    """``refiner``, ``cross``, ``joint`` (a second stream's projections concatenated in) or ``self``.

    From the module alone: HunyuanVideo's token refiner by name; cross-attention by
    ``is_cross_attention`` (Wan, old ``Attention``) or, where a module has no such flag
    (LTX), by the name ``attn2``; joint by added K/V projections (Flux double blocks,
    SD3, Qwen-Image, HunyuanVideo) or CogVideoX's processor, which prepends the text.
    """
    leaf = (name or "").rsplit(".", 1)[-1]
    if "refiner" in (name or ""):
        return "refiner"
    cross = getattr(module, "is_cross_attention", None)
    if cross is None:
        cross = leaf == "attn2" and getattr(module, "added_kv_proj_dim", None) is None and not hasattr(module, "add_k_proj")
    if cross:
        return "cross"
    if getattr(module, "added_kv_proj_dim", None) is not None or getattr(module, "add_k_proj", None) is not None:
        return "joint"
    if type(stock).__name__.startswith("CogVideoX"):
        return "joint"
    return "self"
