"""Route selection as data: each kernel route lists why it cannot serve a call.

As in xformers' ``fmha`` dispatch, ``backend="auto"`` takes the first route (in
priority order) with no reasons; an explicit backend that cannot serve the call,
or a call no route can serve, raises ``NoRouteError`` listing every route's reasons.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .config import QuantConfig
from .layout import PackedLayout

__all__ = [
    "AttentionCall",
    "AttentionResult",
    "Capabilities",
    "NoRouteError",
    "Route",
    "register_route",
    "get_route",
    "route_names",
    "select_route",
    "device_sm",
]


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """One attention call at the kernel boundary: packed ``[tokens, heads, dim]`` tensors."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout: PackedLayout
    softmax_scale: float
    #: ``skip_softmax_threshold_scale_factor``: ``lambda = skip_factor / kv_len``; None = dense.
    skip_factor: float | None = None
    #: SAGE settings, or None for unquantized attention.
    quant: QuantConfig | None = None
    #: Ask the route for skipped / total tile counts (a debug cost on kernels).
    collect_stats: bool = False
    #: Attention role ("self", "cross", "joint", ...) for messages.
    role: str = "self"
    #: Also return each query row's log-sum-exp (ring attention merges KV shards by it).
    return_lse: bool = False
    #: The keys are one of this many equal KV shards of the sequence (ring attention's degree).
    kv_shards: int = 1

    def describe(self) -> str:
        tokens, heads, dim = self.q.shape
        parts = [f"{self.q.dtype} q[{tokens}, {heads}, {dim}] kv_heads={self.k.shape[1]}"]
        parts.append(f"{self.layout.num_seqs} sequence(s)")
        if self.skip_factor is not None:
            parts.append("skip-softmax")
        if self.quant is not None:
            parts.append(f"SAGE {self.quant.dtype_qk}")
        if self.return_lse:
            parts.append(f"log-sum-exp (ring over {self.kv_shards} KV shards)")
        sm = device_sm(self.q.device)
        parts.append(f"on {self.q.device}" + (f" (sm_{sm})" if sm else ""))
        return ", ".join(parts)


@dataclass
class AttentionResult:
    out: torch.Tensor
    route: str
    skipped_tiles: int | None = None
    total_tiles: int | None = None
    #: What ran (``run_attention`` fills these in): skip-softmax on, SAGE on, and what the policy dropped.
    sparse: bool = False
    sage: bool = False
    note: str | None = None
    #: ``[q_tokens, heads]`` float32 natural log-sum-exp of each row's scaled logits over the keys it
    #: attended (skipped tiles excluded), when the call asked for it; ``run_attention`` unpacks it to
    #: ``[batch, q_len, heads]``.
    lse: torch.Tensor | None = None

    @property
    def skipped_fraction(self) -> float | None:
        if self.skipped_tiles is None or not self.total_tiles:
            return None
        return self.skipped_tiles / self.total_tiles


@functools.lru_cache(maxsize=None)
def _sm_of(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


def device_sm(device: torch.device) -> int | None:
    """SM number (90 for H100/H200, 100 for B200) of a CUDA device, or None elsewhere."""
    if device.type != "cuda":
        return None
    return _sm_of(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class Capabilities:
    """What a route can do, checked against a call by ``Route.not_supported_reasons``."""

    device_types: frozenset[str] = frozenset({"cuda"})
    #: Exact SM numbers served, or None for any.
    sms: frozenset[int] | None = None
    #: Lowest SM served (checked when ``sms`` is None).
    min_sm: int | None = None
    dtypes: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16})
    head_dims: frozenset[int] | None = None
    skip_softmax: bool = False
    sage_dtypes: frozenset[str] = frozenset()
    grouped_query: bool = True
    #: Returns each row's log-sum-exp (``AttentionCall.return_lse``), as ring attention needs.
    lse: bool = False


class Route(ABC):
    """A kernel route. Subclasses set ``name``, ``caps`` and implement ``run``."""

    name: ClassVar[str]
    caps: ClassVar[Capabilities]
    #: Whether ``backend="auto"`` may pick it (the reference is an oracle, never auto).
    auto: ClassVar[bool] = True

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = _capability_reasons(self.caps, call)
        if not reasons:
            reasons += self.extra_reasons(call)
        return reasons

    def extra_reasons(self, call: AttentionCall) -> list[str]:
        """Reasons beyond the capability table (a missing package, a missing compiler)."""
        return []

    def priority(self, call: AttentionCall) -> float:
        """Lower runs first under ``backend="auto"``; default is registration order."""
        return float(_ORDER.index(self.name))

    @abstractmethod
    def run(self, call: AttentionCall) -> AttentionResult: ...


def _capability_reasons(caps: Capabilities, call: AttentionCall) -> list[str]:
    reasons: list[str] = []
    device = call.q.device
    if device.type not in caps.device_types:
        reasons.append(f"runs on {sorted(caps.device_types)}, not {device.type}")
    else:
        sm = device_sm(device)
        if sm is not None:
            if caps.sms is not None and sm not in caps.sms:
                reasons.append(f"needs SM in {sorted(caps.sms)}, this GPU is sm_{sm}")
            elif caps.sms is None and caps.min_sm is not None and sm < caps.min_sm:
                reasons.append(f"needs SM >= {caps.min_sm}, this GPU is sm_{sm}")
    if call.q.dtype not in caps.dtypes:
        reasons.append(f"dtype {call.q.dtype} not in {sorted(str(d) for d in caps.dtypes)}")
    dim = call.q.shape[-1]
    if caps.head_dims is not None and dim not in caps.head_dims:
        reasons.append(f"head dim {dim} not in {sorted(caps.head_dims)}")
    if call.k.shape[1] != call.q.shape[1] and not caps.grouped_query:
        reasons.append("grouped-query attention (fewer KV heads than Q heads) not supported")
    if call.skip_factor is not None and not caps.skip_softmax:
        reasons.append("no skip-softmax")
    if call.quant is not None and call.quant.dtype_qk not in caps.sage_dtypes:
        reasons.append(
            f"no SAGE with dtype_qk={call.quant.dtype_qk}" if caps.sage_dtypes else "no SAGE quantization"
        )
    if call.return_lse and not caps.lse:
        reasons.append("returns no log-sum-exp (ring attention merges KV shards by it)")
    return reasons


_ROUTES: dict[str, Route] = {}
_ORDER: list[str] = []


def register_route(route: Route) -> Route:
    """Add a route; earlier registrations run first under ``auto`` unless ``priority`` says otherwise."""
    _ROUTES[route.name] = route
    if route.name not in _ORDER:
        _ORDER.append(route.name)
    return route


def get_route(name: str) -> Route:
    _load_builtin_routes()
    try:
        return _ROUTES[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; choose 'auto' or one of {route_names()}.") from None


def route_names() -> list[str]:
    _load_builtin_routes()
    return list(_ORDER)


class NoRouteError(ValueError):
    """No route (or not the requested one) can serve the call; lists every route's reasons."""

    def __init__(self, call: AttentionCall, requested: str, reasons: dict[str, list[str]]) -> None:
        self.reasons = reasons
        lines = [f"{name}: {'; '.join(r) if r else 'can serve it'}" for name, r in reasons.items()]
        head = (
            f"backend={requested!r} cannot serve this attention call"
            if requested != "auto"
            else "no attention route can serve this call"
        )
        advice = []
        if call.skip_factor is not None or call.quant is not None:
            advice.append("pass fallback='dense' to run it without skip-softmax/SAGE (one warning says so)")
        if requested != "auto":
            advice.append("or backend='auto' to let the library choose")
        super().__init__(
            f"{head} [{call.role}: {call.describe()}]:\n  "
            + "\n  ".join(lines)
            + (f"\n{'; '.join(advice)}." if advice else "")
        )


def select_route(call: AttentionCall, backend: str = "auto") -> Route:
    """The route that will run ``call``; raises ``NoRouteError`` with every route's reasons."""
    _load_builtin_routes()
    if backend != "auto":
        route = get_route(backend)
        if not route.not_supported_reasons(call):
            return route
    else:
        candidates = sorted((r for r in _ROUTES.values() if r.auto), key=lambda r: r.priority(call))
        for route in candidates:
            if not route.not_supported_reasons(call):
                return route
    reasons = {name: r.not_supported_reasons(call) for name, r in _ROUTES.items()}
    for name, r in _ROUTES.items():
        if not r.auto and not reasons[name] and backend == "auto":
            reasons[name] = [f"never chosen automatically; pass backend={name!r}"]
    raise NoRouteError(call, backend, reasons)


@functools.lru_cache(maxsize=None)
def _load_builtin_routes() -> None:
    """Import the route modules once; each registers itself. Optional ones fail soft."""
    import importlib

    for module in ROUTE_MODULES:
        importlib.import_module(f"{__package__}.kernels.{module}")
    # A module imported by another registers early: restore ROUTE_MODULES' order (others keep theirs, after).
    def position(name: str) -> int:
        module = type(_ROUTES[name]).__module__.rsplit(".", 1)[-1]
        return ROUTE_MODULES.index(module) if module in ROUTE_MODULES else len(ROUTE_MODULES)

    _ORDER.sort(key=position)


#: Route modules in default priority order (fastest specialised kernels first).
ROUTE_MODULES = ("trtllm_gen", "fa3", "fmha_v2", "fmha_v2_fp8", "triton_attn", "sdpa", "gluon_attn", "reference")
