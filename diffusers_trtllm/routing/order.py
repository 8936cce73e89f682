"""The ranked list of routes for a call, and the choice of the route that runs it.

As in xformers' ``fmha`` dispatch (``_dispatch_fw_priority_list``), one function,
:func:`ranked_routes`, lists for a call the routes ``backend="auto"`` tries, fastest
first; :func:`select_route` runs the first one whose ``not_supported_reasons`` is empty.
An explicit backend that cannot serve the call, or a call no route can serve, raises
:class:`NoRouteError` listing every route's reasons. Kernel modules only declare what
they can do (``Capabilities``, ``extra_reasons``); where they rank is written here, with
the measurement behind it. Adding a route: one name in the lists below (docs/design.md,
"Adding a route").
"""

from __future__ import annotations

from .registry import AttentionCall, Route, device_sm, get_route, load_routes, registered_routes

__all__ = ["ranked_routes", "select_route", "NoRouteError", "SM90_DENSE_ORDER", "TEXT_KV", "LONG_KV", "kv_bucket"]

#: KV lengths up to this many tokens count as "text" (cross-attention to a prompt's tokens; Wan-14B's
#: cross-attention has 512 keys: benchmarks/results/hopper_cross_h200.md).
TEXT_KV = 1024
#: KV lengths up to this many tokens count as "short" (images: flux_1024's 4,608 keys, qwen_image_1328's
#: 7,193), longer as "long" (video: the Wan shapes' 32,760 and 75,600); benchmarks/results/bench_h200.md.
LONG_KV = 16384

#: Dense routes on SM90 by (head dim, KV bucket), fastest first, as measured on the H200
#: (benchmarks/results/bench_h200.md; speed vs cuDNN, bf16, FlashInfer 0.7.4, torch 2.11, one run each):
#: - D=64 short (sd3_1024): fmha-v2 1.10, fa3 1.08, cuDNN 1.00 (an earlier run: 1.12, 1.12, 1.00);
#: - D=128 short (flux_1024, qwen_image_1328): fa3 0.95-1.18, cuDNN 0.99-1.04, fmha-v2 0.88-0.96;
#: - D=128 long (the Wan shapes): fa3 1.11-1.16, cuDNN 1.00, fmha-v2 1.00-1.01;
#: - D=128 text (Wan-14B cross-attention, 32,760 queries x 512 keys; benchmarks/results/hopper_cross_h200.md):
#:   cuDNN 1.00, fa3 0.77 (fmha-v2 cannot serve unequal query and key counts).
#: The project's kernels run dense right behind ``sdpa`` (triton's dense path measured 0.70-0.90x cuDNN,
#: benchmarks/results/triton_h200.md; gluon just behind it).
SM90_DENSE_ORDER: dict[tuple[int, str], tuple[str, ...]] = {
    (128, "text"): ("sdpa", "triton", "gluon", "fa3", "fmha-v2"),
    (64, "short"): ("fmha-v2", "fa3", "sdpa", "triton", "gluon"),
    (128, "short"): ("fa3", "sdpa", "triton", "gluon", "fmha-v2"),
    (128, "long"): ("fa3", "sdpa", "triton", "gluon", "fmha-v2"),
}


def kv_bucket(max_seqlen_kv: int) -> str:
    """``"text"``, ``"short"`` or ``"long"``: the KV-length classes the measurements speak of."""
    return "text" if max_seqlen_kv <= TEXT_KV else "short" if max_seqlen_kv <= LONG_KV else "long"


def ranked_routes(call: AttentionCall) -> list[str]:
    """The routes ``backend="auto"`` tries for ``call``, in order (the first that can serve it runs)."""
    hopper = device_sm(call.q.device) == 90
    if call.quant is not None:  # SAGE, with or without skip-softmax
        if hopper:
            # fmha-v2-fp8 first: the fastest fp8 kernel on Hopper, skip-softmax included, and as accurate as
            # per-block fp8 (Wan-14B 1.42x cuDNN; benchmarks/results/hopper_h200.md).
            # int8: sage-sm90 ahead of triton at every length since the quantizer's launches and the routing were
            # cut (issue 57): on an H100, flux_1024 0.652x / 0.581x cuDNN and 16,896 keys 1.295x / 1.051x
            # (benchmarks/results/profile_call_h100_run1.md); long keys (wan_14b_480p / 720p) 1.24x / 1.35x
            # against 1.10x / 1.15x before it (benchmarks/results/sage_sm90_sweep_h200.md).
            return ["fmha-v2-fp8", "trtllm-gen", "fa3", "fmha-v2", "sage-sm90", "triton", "gluon", "sdpa"]
        return ["trtllm-gen", "fa3", "fmha-v2", "fmha-v2-fp8", "triton", "gluon", "sdpa"]
    if call.skip_factor is not None:  # skip-softmax alone
        # gluon first (SM90 only): at 50% skipped 1.16x / 1.17x cuDNN on wan_14b_480p / 720p against fmha-v2's
        # 1.12x (benchmarks/results/gluon_h200.md); it returns no log-sum-exp, so a ring shard takes fmha-v2.
        if hopper:
            return ["gluon", "fmha-v2", "trtllm-gen", "fa3", "fmha-v2-fp8", "triton", "sdpa"]
        return ["gluon", "trtllm-gen", "fa3", "fmha-v2", "fmha-v2-fp8", "triton", "sdpa"]
    measured = SM90_DENSE_ORDER.get((call.q.shape[-1], kv_bucket(call.layout.max_seqlen_kv))) if hopper else None
    if measured is not None:
        return [*measured, "trtllm-gen", "fmha-v2-fp8"]
    return ["trtllm-gen", "fa3", "fmha-v2", "fmha-v2-fp8", "sdpa", "triton", "gluon"]


def _auto_candidates(call: AttentionCall) -> list[Route]:
    """``ranked_routes``, then any other route registered for ``auto`` (a user's), in registration order."""
    ranked = ranked_routes(call)
    routes = registered_routes()
    listed = [routes[name] for name in ranked if name in routes]
    return [r for r in listed if r.auto] + [r for name, r in routes.items() if r.auto and name not in ranked]


class NoRouteError(ValueError):
    """No route (or not the requested one) can serve the call; lists every route's reasons.

    ``brief``: the same on one line (the requested route's reasons and the advice), for the command line,
    which prints one line and would otherwise show only the heading.
    """

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
        own = f": {'; '.join(reasons[requested])}" if reasons.get(requested) else ""
        self.brief = f"{head} [{call.role}: {call.describe()}]{own}" + (f"; {'; '.join(advice)}." if advice else ".")
        super().__init__(
            f"{head} [{call.role}: {call.describe()}]:\n  "
            + "\n  ".join(lines)
            + (f"\n{'; '.join(advice)}." if advice else "")
        )


def select_route(call: AttentionCall, backend: str = "auto") -> Route:
    """The route that will run ``call``; raises ``NoRouteError`` with every route's reasons."""
    load_routes()
    if backend != "auto":
        route = get_route(backend)
        if not route.not_supported_reasons(call):
            return route
    else:
        for route in _auto_candidates(call):
            if not route.not_supported_reasons(call):
                return route
    routes = registered_routes()
    reasons = {name: r.not_supported_reasons(call) for name, r in routes.items()}
    for name, r in routes.items():
        if not r.auto and not reasons[name] and backend == "auto":
            reasons[name] = [f"never chosen automatically; pass backend={name!r}"]
    raise NoRouteError(call, backend, reasons)
