"""What routes are: the call at the kernel boundary, its result, capabilities, and the registry of routes.

Each kernel route lists why it cannot serve a call (``Route.not_supported_reasons``: its
capability table, then its own checks); where it ranks under ``backend="auto"`` is
``routing.order``'s business, never the route's.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch

from ..config import QuantConfig
from ..layout import PackedLayout

__all__ = [
    "AttentionCall",
    "AttentionResult",
    "Capabilities",
    "Route",
    "register_route",
    "get_route",
    "route_names",
    "registered_routes",
    "registry_epoch",
    "load_routes",
    "capability_reasons",
    "device_sm",
    "ROUTE_MODULES",
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

    def fixed_fields(self) -> dict[str, Any]:
        """Every field but the tensors and the skip factor: what ``attention``'s plans keep (``assemble``)."""
        return {name: value for name, value in vars(self).items() if name not in ("q", "k", "v", "skip_factor")}

    @classmethod
    def assemble(cls, fixed: Mapping[str, Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 skip_factor: float | None) -> "AttentionCall":
        """The call of ``fixed`` (``fixed_fields()`` of a checked call) on these tensors, built without the
        frozen ``__init__``'s ``object.__setattr__`` per field (about 1 us of CPU a call; issue 57)."""
        call = object.__new__(cls)
        fields = call.__dict__
        fields.update(fixed)
        fields["q"], fields["k"], fields["v"], fields["skip_factor"] = q, k, v, skip_factor
        return call

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
    #: Reads K scales split per thread (``QuantConfig.k_per_thread``).
    k_per_thread: bool = False
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
        """Every reason this route cannot serve ``call``: the capability table's, then its own."""
        return capability_reasons(self.caps, call) + self.extra_reasons(call)

    def extra_reasons(self, call: AttentionCall) -> list[str]:
        """Reasons beyond the capability table (a missing package, a missing compiler); asked for every call."""
        return []

    @abstractmethod
    def run(self, call: AttentionCall) -> AttentionResult: ...


def capability_reasons(caps: Capabilities, call: AttentionCall) -> list[str]:
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
    if call.quant is not None and call.quant.k_per_thread and not caps.k_per_thread:
        reasons.append("no K scales per thread (quant.k_per_thread=True: sage-sm90 and the reference read them)")
    if call.return_lse and not caps.lse:
        reasons.append("returns no log-sum-exp (ring attention merges KV shards by it)")
    return reasons


_ROUTES: dict[str, Route] = {}

#: The built-in route modules (under ``kernels/``), in the order ``route_names`` lists them.
ROUTE_MODULES = ("trtllm_gen", "fa3", "fmha_v2", "fmha_v2_fp8", "sage_sm90", "triton_attn", "sdpa", "gluon_attn", "reference")


_EPOCH = [0]


def register_route(route: Route) -> Route:
    """Add a route under its name (``routing.order.ranked_routes`` says where ``auto`` tries it)."""
    _ROUTES[route.name] = route
    _EPOCH[0] += 1
    return route


def registry_epoch() -> int:
    """Changes whenever a route is registered (the built-in ones loaded first): decisions cached before it
    (``attention._PLANS``) no longer hold."""
    load_routes()
    return _EPOCH[0]


def get_route(name: str) -> Route:
    load_routes()
    try:
        return _ROUTES[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; choose 'auto' or one of {route_names()}.") from None


def route_names() -> list[str]:
    """Every registered route: the built-in ones in ``ROUTE_MODULES`` order, then any other."""
    return list(registered_routes())


def registered_routes() -> dict[str, Route]:
    """Name -> route, in ``route_names`` order (a copy)."""
    load_routes()
    return dict(_ROUTES)


@functools.lru_cache(maxsize=None)
def load_routes() -> None:
    """Import the route modules once; each registers itself. Optional ones fail soft."""
    import importlib

    for module in ROUTE_MODULES:
        importlib.import_module(f"{__package__.rsplit('.', 1)[0]}.kernels.{module}")

    # A module imported by another registers early: put ROUTE_MODULES' order back (others keep theirs, after).
    def position(route: Route) -> int:
        module = type(route).__module__.rsplit(".", 1)[-1]
        return ROUTE_MODULES.index(module) if module in ROUTE_MODULES else len(ROUTE_MODULES)

    ordered = sorted(_ROUTES.values(), key=position)
    _ROUTES.clear()
    _ROUTES.update((route.name, route) for route in ordered)
