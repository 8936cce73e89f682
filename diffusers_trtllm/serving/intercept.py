"""Routing a family's core attention call to our kernels, keeping everything else stock.

Each family's own processor (projections, QK norm, RoPE, text concatenation) keeps
running; only the attention call inside it is redirected (and, for the processors
:mod:`.rotary` lists, the rotary embedding it was handed is applied at that call instead). While one of our layers
runs its stock processor, this thread's :data:`_CALL` names that layer, and the
functions the processor reaches for are rebound in its module:

- ``dispatch_attention_fn`` (Flux, Wan, LTX, Qwen-Image, Cosmos, ...: every
  ``AttentionModuleMixin`` family, with or without ``backend=``), and
- ``F`` (``torch.nn.functional``), whose ``scaled_dot_product_attention`` the older
  processors (SD3, CogVideoX, ``AttnProcessor2_0``) call directly.

The rebound functions take ``*args, **kwargs`` and hand them unchanged to Diffusers'
or torch's own function unless this thread is running one of our layers and the
call is one we serve (no dropout, not causal, no autograd, no layer-skip guidance skipping its scores
(:mod:`.guidance`), not an IP-Adapter's attention to its image prompt (:mod:`.ip_adapter`), no argument
we do not know,
context parallelism as Ulysses, ring or both with even splits, ring without a mask: :mod:`.parallel`). So a stock model, in any thread, is never routed, and
a new Diffusers argument passes through. Everything rebound is recorded and
:func:`restore_globals` puts it back.

Served calls go through one ``torch.library.custom_op`` (a second one, returning the log-sum-exp
too, for ring attention's KV shards) that finds its layer by a
small per-layer tensor (``LayerState.key``), not by a Python int: ``torch.compile``
then sees one opaque op, no graph break, and no guard on which layer it is (layers
configured alike share one compiled graph). In plain eager execution (no tracing, no dispatch mode) the op's
body is called directly: the op's dispatch alone cost more than the rest of our Python on a served call
(benchmarks/results/profile_call_*.md). See docs/design.md.
"""

from __future__ import annotations

import inspect
import sys
import threading
import types
import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as torch_F

from .._logging import info_once, warn_once
from .guidance import attention_scores_skipped
from .parallel import Degrees, context_parallel_attention, served_degrees
from .rotary import take_rotary

__all__ = [
    "register_layer", "unregister_layer", "live_layers", "call_stock", "enter_call", "exit_call", "is_ip_adapter", "ensure_routing", "restore_globals",
    "rebind", "rebound_modules", "stock_attention",
]

#: Per thread: the layer whose stock processor is running, and facts about its call.
_CALL = threading.local()

#: Layer key -> per-layer state (the object stored on the attention module as ``_trtllm_layer``).
_LAYERS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_next_key = 0
_KEY_LOCK = threading.Lock()

#: Module name (or ``"module:Class"``) -> {global or attribute name: Diffusers' or torch's original} for everything
#: we rebound (``serving.qk_norm`` rebinds ``RMSNorm.forward``).
_REBOUND: dict[str, dict[str, Any]] = {}


def register_layer(state: Any) -> torch.Tensor:
    """A fresh key (a 0-d CPU int64 tensor) under which the custom op finds ``state``."""
    global _next_key
    with _KEY_LOCK:
        _next_key += 1
        key = _next_key
    _LAYERS[key] = state
    return torch.tensor(key, dtype=torch.int64)


def unregister_layer(key: torch.Tensor) -> None:
    _LAYERS.pop(int(key), None)


def live_layers() -> int:
    """How many layers of ours are alive (registered and not garbage-collected)."""
    return len(_LAYERS)


# ---- the custom ops ------------------------------------------------------------------------
def _layer(layer_key: torch.Tensor) -> Any:
    state = _LAYERS.get(int(layer_key))
    if state is None:
        raise RuntimeError(
            f"diffusers_trtllm: attention layer {int(layer_key)} is gone (its module was freed or uninstalled); "
            "reinstall the processor with diffusers_trtllm.install(model, proc)."
        )
    return state


def _capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph (torch asks the current device's)."""
    if device.type != "cuda":
        return False
    if device.index is None or device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _refuse_graph_capture(query: torch.Tensor) -> None:
    """Refuse to run inside a CUDA graph capture (``torch.compile(mode="reduce-overhead")``) on the query's GPU, in
    one line. A capture itself now succeeds (``benchmarks/capture_probe.py`` on an H200, defaults and int8), but a
    replay would repeat the host's decisions of the captured call (the timestep gate, a calibration's step), and
    replays are not tested."""
    if _capturing(query.device):
        raise RuntimeError(
            "diffusers_trtllm: our attention cannot run inside a CUDA graph (torch.compile(mode='reduce-overhead') "
            "or torch.cuda.graph); compile with mode='max-autotune-no-cudagraphs' or "
            "transformer.compile_repeated_blocks(fullgraph=True) instead."
        )


@torch.library.custom_op("diffusers_trtllm::attention", mutates_args=())
def _attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    mask_source: Optional[torch.Tensor],
    timestep: Optional[torch.Tensor],
    layer_key: torch.Tensor,
    scale: Optional[float],
    hidden_len: int,
    encoder_len: int,
    via_sdpa: bool,
) -> torch.Tensor:
    """``[B, S, H, D]`` attention of the layer named by ``layer_key`` (opaque to ``torch.compile``).

    ``hidden_len`` / ``encoder_len``: token counts of the processor's inputs (-1: absent), from
    which the layer learns its role; ``via_sdpa``: the call came through ``F`` (its stock path).
    """
    _refuse_graph_capture(query)
    return _layer(layer_key).serve(query, key, value, attn_mask, mask_source, timestep, scale, hidden_len,
                                   encoder_len, via_sdpa)


@_attention_op.register_fake
def _attention_fake(query, key, value, attn_mask, mask_source, timestep, layer_key, scale, hidden_len, encoder_len,
                    via_sdpa):
    return query.new_empty(*query.shape[:-1], value.shape[-1])


@torch.library.custom_op("diffusers_trtllm::attention_kv_shard", mutates_args=())
def _kv_shard_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    timestep: Optional[torch.Tensor],
    layer_key: torch.Tensor,
    scale: Optional[float],
    hidden_len: int,
    encoder_len: int,
    kv_shards: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention over one of ``kv_shards`` KV shards: ``[B, S, H, D]`` output and ``[B, S, H]`` float32
    log-sum-exp (unmasked; arguments as ``diffusers_trtllm::attention``'s)."""
    _refuse_graph_capture(query)
    return _layer(layer_key).serve_kv_shard(query, key, value, timestep, scale, hidden_len, encoder_len, kv_shards)


@_kv_shard_op.register_fake
def _kv_shard_fake(query, key, value, timestep, layer_key, scale, hidden_len, encoder_len, kv_shards):
    return (query.new_empty(*query.shape[:-1], value.shape[-1]),
            query.new_empty(query.shape[:-1], dtype=torch.float32))


# ---- the call in flight (this thread only) ------------------------------------------------
def _tokens(x: Any) -> int:
    """Token count of a processor's ``hidden_states`` / ``encoder_hidden_states`` (-1: not a tensor)."""
    if not isinstance(x, torch.Tensor):
        return -1
    if x.ndim == 4:  # UNet attention gets [B, C, H, W] and flattens it
        return x.shape[2] * x.shape[3]
    return x.shape[1] if x.ndim >= 2 else -1


def _argument(index: int | None, name: str, args: tuple, kwargs: dict) -> Any:
    if name in kwargs:
        return kwargs[name]
    if index is not None and index < len(args):
        return args[index]
    return None


def _mask_source(mask_params: tuple[tuple[int, str], ...], args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The one mask tensor the caller passed (the family derives its attention mask from it), else None."""
    found = None
    for index, name in mask_params:
        value = _argument(index, name, args, kwargs)
        if value is not None:
            if found is not None:
                return None
            found = value
    return found if isinstance(found, torch.Tensor) else None


def enter_call(state: Any, args: tuple, kwargs: dict) -> tuple:
    """Name ``state`` as this thread's layer for the processor call about to run with ``args`` / ``kwargs``
    (its stock processor's, or its attention module's forward for a layer served in place: ``serving.ip_adapter``);
    returns what :func:`exit_call` puts back."""
    previous = (getattr(_CALL, "layer", None), getattr(_CALL, "mask_source", None), getattr(_CALL, "hidden_len", -1),
                getattr(_CALL, "encoder_len", -1), getattr(_CALL, "rotary", None),
                getattr(_CALL, "attention_calls", None))
    _CALL.layer = state
    _CALL.mask_source = _mask_source(state.mask_params, args, kwargs)
    hidden = _argument(state.hidden_index, "hidden_states", args, kwargs)
    encoder = _argument(state.encoder_index, "encoder_hidden_states", args, kwargs)
    _CALL.hidden_len = _tokens(hidden)
    _CALL.encoder_len = -1 if encoder is hidden else _tokens(encoder)  # OmniGen passes hidden states twice
    _CALL.rotary = None
    _CALL.attention_calls = 0 if state.image_prompt else None
    return previous


def exit_call(previous: tuple) -> None:
    """Put back what :func:`enter_call` found."""
    (_CALL.layer, _CALL.mask_source, _CALL.hidden_len, _CALL.encoder_len, _CALL.rotary,
     _CALL.attention_calls) = previous


def call_stock(state: Any, attn: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """Run the layer's stock processor with this thread's calls to it routed to ``state``."""
    previous = enter_call(state, args, kwargs)
    try:
        if state.rotary is not None:  # we rotate Q and K at its attention call (serving.rotary)
            args, kwargs, _CALL.rotary = take_rotary(state.rotary, attn, args, kwargs)
        return state.stock(attn, *args, **kwargs)
    finally:
        exit_call(previous)


def is_ip_adapter(processor: Any) -> bool:
    """Whether ``processor`` is an IP-Adapter's (Diffusers' convention: a module with the image keys' ``to_k_ip``):
    its attention calls after the first attend to the image prompt's tokens and run stock."""
    return isinstance(processor, torch.nn.Module) and hasattr(processor, "to_k_ip")


def _image_prompt_call() -> bool:
    """Whether this attention call of an IP-Adapter's processor attends to the image prompt's tokens: every call
    after its first, which is the layer's own attention (Flux, SD3 and ``IPAdapterAttnProcessor2_0`` alike)."""
    calls = getattr(_CALL, "attention_calls", None)
    if calls is None:
        return False
    _CALL.attention_calls = calls + 1
    return calls > 0


#: ``_route``'s default mask source: the one this thread's processor call passed.
_CALL_MASK = object()


def _route(state: Any, query, key, value, attn_mask, scale, via_sdpa: bool, shards: int = 1,
           mask_source: Any = _CALL_MASK, kv_shards: int = 0):
    """Our op for this thread's call; ``shards``: the processor saw 1/shards of the queries' sequence
    (Ulysses); ``kv_shards > 0``: a ring KV shard (one of that many), returning ``(out, lse)``."""
    tracker = state.tracker
    timestep = tracker.tensor if tracker is not None else None

    def tokens(n: int) -> int:
        return n * shards if n >= 0 else n

    if kv_shards:
        if _eager():
            return state.serve_kv_shard(query, key, value, timestep, scale, tokens(_CALL.hidden_len),
                                        tokens(_CALL.encoder_len), kv_shards)
        return torch.ops.diffusers_trtllm.attention_kv_shard(
            query, key, value, timestep, state.key, scale, tokens(_CALL.hidden_len), tokens(_CALL.encoder_len),
            kv_shards)
    source = _CALL.mask_source if mask_source is _CALL_MASK else mask_source
    if _eager():
        return state.serve(query, key, value, attn_mask, source, timestep, scale, tokens(_CALL.hidden_len),
                           tokens(_CALL.encoder_len), via_sdpa)
    return torch.ops.diffusers_trtllm.attention(
        query, key, value, attn_mask, source, timestep, state.key, scale, tokens(_CALL.hidden_len),
        tokens(_CALL.encoder_len), via_sdpa,
    )


def _eager() -> bool:
    """Plain eager execution: no ``torch.compile`` tracing and no dispatch mode (fake tensors, ``make_fx``), where
    the custom op would only add its dispatch (tens of microseconds a call) before running the same ``serve``."""
    return not torch.compiler.is_compiling() and not torch._C._len_torch_dispatch_stack()


def _route_parallel(state: Any, query, key, value, attn_mask, scale, parallel_config: Any,
                    degrees: Degrees) -> torch.Tensor:
    """Diffusers' context-parallel exchanges around our op: each rank serves the whole sequence of its heads
    (Ulysses), or its queries against one KV shard at a time (ring), or both."""

    def run(q, k, v, mask, return_lse):
        if return_lse:  # a ring shard (unmasked: see _servable_arguments)
            return _route(state, q, k, v, None, scale, False, degrees.ulysses, kv_shards=degrees.ring)
        # A mask over local keys arrives all-gathered: a new tensor, so the layout is keyed on it, not on the source.
        return _route(state, q, k, v, mask, scale, False, degrees.ulysses,
                      mask_source=_CALL_MASK if mask is attn_mask else None)

    return context_parallel_attention(run, query, key, value, attn_mask, scale, parallel_config)


# ---- argument handling, derived from the installed functions -----------------------------
#: Arguments we serve, and the value each must have for us to serve the call.
_MUST_BE = {"dropout_p": (0.0, 0), "is_causal": (False, None), "attention_kwargs": (None,)}
_USED = ("attn_mask", "scale", "parallel_config")
_IGNORED = ("enable_gqa", "backend")  # GQA follows from the head counts; the backend is the stock path's


def _positional_names(fn: Callable) -> tuple[str, ...]:
    """Names of ``fn``'s positional parameters after query, key, value."""
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return tuple(p.name for p in params[3:])


def _servable_arguments(names: tuple[str, ...], args: tuple, kwargs: dict, query: torch.Tensor,
                        key: torch.Tensor) -> tuple[Optional[dict], str]:
    """``({"attn_mask", "scale", "parallel_config", "degrees"}, "")`` if we serve this call, else ``(None, why)``
    (it then runs stock, unchanged); ``degrees``: the Ulysses and ring degrees of a context-parallel call."""
    if _image_prompt_call():
        return None, "it attends to the IP-Adapter's image-prompt tokens (the layer's own attention is served)"
    if torch.is_grad_enabled() and query.requires_grad:
        return None, "autograd is on (the inputs require grad) and our kernels have no backward"
    if attention_scores_skipped():
        return None, "layer-skip guidance skips its attention scores (Diffusers answers F.scaled_dot_product_attention)"
    if len(args) > len(names):
        return None, "it passes more positional arguments than this version knows"
    given = dict(zip(names, args))
    given.update(kwargs)
    mask = given.get("attn_mask")
    if mask is not None and not isinstance(mask, torch.Tensor):
        return None, f"its mask is a {type(mask).__name__}, not a tensor"  # a flex-attention BlockMask and the like
    for name, value in given.items():
        if name in _MUST_BE:
            if value not in _MUST_BE[name] and not (name == "attention_kwargs" and not value):
                return None, f"{name}={value!r}"
        elif name not in _USED and name not in _IGNORED and value is not None and value is not False:
            return None, f"it passes {name}={value!r}, which this version does not know"
    parallel_config = given.get("parallel_config")
    degrees = None
    if parallel_config is not None:
        degrees = served_degrees(parallel_config)
        if degrees is None or key.shape[2] != query.shape[2]:  # uneven splits, GQA: Diffusers' own path
            return None, ("context parallelism with uneven splits (ulysses_anything, ring_anything) or grouped-query "
                          "attention runs Diffusers' own attention; ContextParallelConfig(ulysses_degree=..., "
                          "ring_degree=...) is served")
        if degrees.ring > 1 and mask is not None:  # Diffusers hands every KV shard the same mask
            return None, ("a masked call under ring attention runs Diffusers' own attention (every KV shard gets "
                          "the same mask); unmasked calls and Ulysses are served")
    return {"attn_mask": given.get("attn_mask"), "scale": given.get("scale"), "parallel_config": parallel_config,
            "degrees": degrees}, ""


def _left_stock(state: Any, why: str) -> None:
    """A call of a served layer that runs stock: recorded in its step table, and said once per cause.

    Autograd is a warning (what was asked, skip-softmax or SAGE, not running would surprise); the other
    causes (causal or dropout calls, flex masks, new arguments) are by design and logged at info."""
    state.record_stock(why)
    if why.startswith("autograd"):
        warn_once(("stock-autograd",),
                  "diffusers_trtllm: attention role %r (%s) runs the family's stock attention while %s; run inference "
                  "under torch.no_grad() or torch.inference_mode() to use TrtllmAttnProcessor's kernels.",
                  state.role, state.label, why)
    else:
        info_once(("stock-call", why), "diffusers_trtllm: attention role %r (%s) runs stock for calls where %s.",
                  state.role, state.label, why)


def _turned(query, key):
    """Q and K ``[B, S, H, D]`` turned by the rotation this thread's processor left to us (``serving.rotary``), once,
    whichever way its attention call then goes; as they are where it left none."""
    turn = getattr(_CALL, "rotary", None)
    if turn is None:
        return query, key
    _CALL.rotary = None
    return turn(query, key)


def _routed_dispatch(original: Callable) -> Callable:
    names = _positional_names(original)

    def dispatch_attention_fn(query, key, value, *args, **kwargs):
        state = getattr(_CALL, "layer", None)
        query, key = _turned(query, key)
        if state is not None:
            served, why = _servable_arguments(names, args, kwargs, query, key)
            if served is None:
                _left_stock(state, why)
            elif served["degrees"] is not None and served["degrees"].ring > 1 and state.settings().mode == "stock":
                pass  # a ring shard needs our op's log-sum-exp: a stock role keeps Diffusers' ring
            elif served["degrees"] is not None:
                return _route_parallel(state, query, key, value, served["attn_mask"], served["scale"],
                                       served["parallel_config"], served["degrees"])
            else:
                return _route(state, query, key, value, served["attn_mask"], served["scale"], False)
        return original(query, key, value, *args, **kwargs)

    dispatch_attention_fn._trtllm_original = original  # type: ignore[attr-defined]
    return dispatch_attention_fn


def _sdpa_names() -> tuple[str, ...]:
    try:
        return _positional_names(torch_F.scaled_dot_product_attention)
    except (TypeError, ValueError):  # a builtin without a signature: torch's documented order
        return ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


_SDPA_NAMES = _sdpa_names()


def _routed_sdpa(query, key, value, *args, **kwargs):
    """``F.scaled_dot_product_attention`` (``[B, H, S, D]``) that routes while one of our layers runs here."""
    state = getattr(_CALL, "layer", None)
    if getattr(_CALL, "rotary", None) is not None:
        query, key = (x.transpose(1, 2) for x in _turned(query.transpose(1, 2), key.transpose(1, 2)))
    if state is not None:
        served, why = _servable_arguments(_SDPA_NAMES, args, kwargs, query, key)
        if served is None:
            _left_stock(state, why)
        else:
            out = _route(state, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                         served["attn_mask"], served["scale"], True)
            return out.transpose(1, 2)
    return torch_F.scaled_dot_product_attention(query, key, value, *args, **kwargs)


#: ``torch.nn.functional`` with a routing ``scaled_dot_product_attention``.
_F_PROXY = types.ModuleType("diffusers_trtllm.functional", "torch.nn.functional with routed SDPA")
_F_PROXY.__dict__.update({k: v for k, v in vars(torch_F).items() if not k.startswith("__")})
_F_PROXY.scaled_dot_product_attention = _routed_sdpa


# ---- rebinding a module's globals, and putting them back ----------------------------------
def _call_names(stock: Any) -> set[str]:
    """Global names the stock processor's ``__call__`` refers to."""
    code = getattr(getattr(type(stock), "__call__", None), "__code__", None)
    return set(code.co_names) if code is not None else set()


def serving_mode(stock: Any) -> tuple[Optional[str], str]:
    """How a stock processor's attention call is routed: ``("dispatch"|"sdpa"|None, reason)``."""
    module = sys.modules.get(type(stock).__module__)
    if module is None:
        return None, f"its module {type(stock).__module__!r} is not loaded"
    names = _call_names(stock)
    has_dispatch = callable(getattr(module, "dispatch_attention_fn", None))
    has_sdpa = getattr(module, "F", None) in (torch_F, _F_PROXY)
    if "dispatch_attention_fn" in names and has_dispatch:
        return "dispatch", ""
    if "scaled_dot_product_attention" in names and has_sdpa:
        return "sdpa", ""
    if has_dispatch and hasattr(stock, "_attention_backend"):
        return "dispatch", ""  # the call sits in a helper of the same module (Flux2's KV-cache helpers)
    return None, f"{type(stock).__name__} calls neither dispatch_attention_fn nor F.scaled_dot_product_attention"


def ensure_routing(stock: Any) -> None:
    """Rebind the stock processor's module globals (once per module) so its attention calls can route."""
    module = sys.modules.get(type(stock).__module__)
    if module is None:
        return
    current = getattr(module, "dispatch_attention_fn", None)
    if callable(current) and not hasattr(current, "_trtllm_original"):
        rebind(module.__name__, "dispatch_attention_fn", _routed_dispatch(current))
    if getattr(module, "F", None) is torch_F:
        rebind(module.__name__, "F", _F_PROXY)


def _owner(name: str) -> Any:
    """The module ``"package.module"`` or the class ``"package.module:Class"`` names (None: not loaded)."""
    module_name, _, class_name = name.partition(":")
    module = sys.modules.get(module_name)
    return getattr(module, class_name, None) if class_name and module is not None else module


def rebind(name: str, attr: str, value: Any) -> None:
    """Set ``attr`` of the module or class ``name`` names (:func:`_owner`) to ``value``, keeping the first
    original for :func:`restore_globals`."""
    owner = _owner(name)
    _REBOUND.setdefault(name, {}).setdefault(attr, getattr(owner, attr))
    setattr(owner, attr, value)


def restore_globals() -> list[str]:
    """Put back every module global (and class attribute) we rebound; returns the modules and classes touched."""
    touched = []
    for name, saved in list(_REBOUND.items()):
        owner = _owner(name)
        if owner is not None:
            for attr, original in saved.items():
                setattr(owner, attr, original)
            touched.append(name)
        del _REBOUND[name]
    return touched


def rebound_modules() -> list[str]:
    """Names of the modules (and classes) whose globals (attributes) are rebound now."""
    return sorted(name for name, saved in _REBOUND.items() if saved)


def original_dispatch(stock: Any) -> Callable:
    """Diffusers' ``dispatch_attention_fn`` behind our rebinding, for the stock path."""
    module = sys.modules[type(stock).__module__]
    fn = getattr(module, "dispatch_attention_fn", None)
    if fn is None:
        from diffusers.models.attention_dispatch import dispatch_attention_fn as fn
    return getattr(fn, "_trtllm_original", fn)


def stock_attention(state: Any, query, key, value, attn_mask, scale, via_sdpa: bool) -> torch.Tensor:
    """The family's own attention for one call of ``state`` (``[B, S, H, D]``)."""
    enable_gqa = key.shape[2] != query.shape[2]
    if via_sdpa:
        out = torch_F.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attn_mask, scale=scale,
            enable_gqa=enable_gqa,
        )
        return out.transpose(1, 2)
    backend = getattr(state.stock, "_attention_backend", None)
    return original_dispatch(state.stock)(query, key, value, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa,
                                          backend=backend)
