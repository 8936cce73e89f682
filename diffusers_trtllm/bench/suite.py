"""The benchmark loop: every implementation on the same inputs, timed and checked against fp32 dense.

Per shape: make (or load) Q/K/V; compute fp32 dense attention and the skip
statistics with the reference on a subsample of heads; pick skip thresholds
(given, or found for target skipped fractions); then time the baseline (cuDNN
SDPA on CUDA), the other external kernels, and every registered route on every
configuration it can serve (dense, skip-softmax per threshold, SAGE int8/fp8, SAGE
with skip-softmax at each threshold),
plus ``backend="auto"``.
"""

from __future__ import annotations

import gc
import importlib
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from ..config import QuantConfig
from ..kernels.reference import reference_attention
from ..layout import PackedLayout
from ..measure import cosine, rel_l1, skipped_fraction, threshold_for, tile_criticals
from ..routing import AttentionCall, Route, registered_routes, select_route
from ..routing.registry import ROUTE_MODULES
from .external import BASELINE_CPU, BASELINE_CUDA, external_impls
from .inputs import Shape, structured_qkv
from .timing import Timing, time_fn

__all__ = ["Settings", "Row", "run_suite", "available_routes", "reference_tile", "heads_subset", "warm_up", "SAGE_DTYPES"]

SAGE_DTYPES = ("int8", "fp8_e4m3")


@dataclass
class Settings:
    device: str = "cuda"
    dtype: str = "bfloat16"
    locality: float = 0.5
    seed: int = 0
    thresholds: tuple[float, ...] = ()
    target_skips: tuple[float, ...] = (0.25, 0.5, 0.75)
    #: Implementations to run (route names, external names, "auto"); empty = all.
    only: tuple[str, ...] = ()
    ref_heads: int = 4
    warmup: int = 2
    iters: int = 10
    max_seconds: float = 1.0
    time_limit: float = float("inf")
    #: Reference tiles for skip statistics: (query rows, keys); None = fmha-v2's SM90 tiles.
    ref_tile: tuple[int, int] | None = None


@dataclass
class Row:
    shape: str
    impl: str
    config: str
    threshold: float | None = None
    target_skip: float | None = None
    #: SAGE ``dtype_qk`` of the configuration (None: bf16 Q/K).
    quant: str | None = None
    ms: float | None = None
    iters: int | None = None
    tflops: float | None = None
    vs_baseline: float | None = None
    rel_l1: float | None = None
    cosine: float | None = None
    #: Skipped-tile fraction the reference finds on these inputs at this threshold.
    skipped_ref: float | None = None
    #: The reference's own rel-L1 (with skipping / SAGE emulation) against fp32 dense.
    ref_rel_l1: float | None = None
    ideal_speedup: float | None = None
    error: str | None = None


@dataclass
class Config:
    kind: str  # "dense", "skip", "sage" or "sage+skip"
    threshold: float | None = None
    target_skip: float | None = None
    quant: str | None = None

    @property
    def label(self) -> str:
        parts = [f"sage {self.quant}"] if self.quant else []
        if self.threshold is not None:
            target = f", target {self.target_skip:.0%}" if self.target_skip is not None else ""
            parts.append(f"skip {self.threshold:.3g}{target}")
        return " + ".join(parts) or "dense"


@dataclass
class ShapeResult:
    shape: dict[str, Any]
    ref_heads: list[int]
    ref_tile: tuple[int, int]
    skip_curve: dict[str, float] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    not_run: dict[str, str] = field(default_factory=dict)


def available_routes() -> tuple[dict[str, Route], str | None]:
    """The registered routes; a route module that fails to import is reported, not fatal."""
    try:
        return registered_routes(), None
    except Exception as err:  # one broken optional module must not stop the benchmark
        failed = []
        for module in ROUTE_MODULES:
            try:
                importlib.import_module(f"diffusers_trtllm.kernels.{module}")
            except Exception as mod_err:
                failed.append(f"{module}: {type(mod_err).__name__}: {mod_err}")
        return {}, "; ".join(failed) or str(err)


def reference_tile(head_dim: int, override: tuple[int, int] | None = None) -> tuple[int, int]:
    """Tiles of the skip statistics: ``override``, else fmha-v2's SM90 tiles (query rows, keys)."""
    if override is not None:
        return override
    from ..kernels.fmha_v2 import Q_STEP, kv_step

    return (Q_STEP, kv_step(head_dim))


def heads_subset(heads: int, n: int) -> list[int]:
    """``n`` head indices spread over ``range(heads)`` (first and last included)."""
    n = max(1, min(n, heads))
    return sorted({round(i * (heads - 1) / max(n - 1, 1)) for i in range(n)})


class _Shape:
    """Inputs of one shape, packed, with fp32 dense attention and skip statistics on a heads subsample."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, settings: Settings) -> None:
        self.q, self.k, self.v = q, k, v
        self.device = q.device
        b = q.shape[0]
        self.layout = PackedLayout.dense(b, q.shape[1], k.shape[1], self.device)
        self.qp, self.kp, self.vp = (self.layout.pack_q(q), self.layout.pack_kv(k), self.layout.pack_kv(v))
        self.scale = 1.0 / math.sqrt(q.shape[-1])
        self.heads = heads_subset(q.shape[2], settings.ref_heads)
        self.head_idx = torch.tensor(self.heads, device=self.device)
        self.tile = reference_tile(q.shape[-1], settings.ref_tile)
        self.ref = self.reference().out
        self.crit = torch.cat(
            [
                tile_criticals(self.qp[s0:s1][:, self.heads], self.kp[k0:k1][:, self.heads], self.scale, *self.tile)
                for (s0, s1), (k0, k1) in self._seq_bounds()
            ],
            dim=1,
        )

    def _seq_bounds(self):
        lq, lkv = self.q.shape[1], self.k.shape[1]
        return [((i * lq, (i + 1) * lq), (i * lkv, (i + 1) * lkv)) for i in range(self.q.shape[0])]

    def reference(self, threshold: float | None = None, quant: str | None = None):
        """The reference in fp32 on the heads subsample: dense, or skipping at ``threshold``, or SAGE."""
        lay, sub = self.layout, lambda x: x.index_select(1, self.head_idx).float()
        return reference_attention(
            sub(self.qp),
            sub(self.kp),
            sub(self.vp),
            lay.cu_seqlens_q,
            lay.cu_seqlens_kv,
            lay.q_lens,
            lay.kv_lens,
            softmax_scale=self.scale,
            skip_factor=None if threshold is None else threshold * lay.max_seqlen_kv,
            quant=QuantConfig(dtype_qk=quant) if quant else None,
            tile_q=self.tile[0],
            tile_kv=self.tile[1],
        )

    def accuracy(self, out: torch.Tensor) -> tuple[float, float]:
        """rel-L1 and cosine of a ``[tokens, heads, dim]`` output against fp32 dense, on the heads subsample."""
        sub = out.reshape(-1, *out.shape[-2:]).index_select(1, self.head_idx).float()
        return rel_l1(sub, self.ref), cosine(sub, self.ref)

    def call(self, config: Config) -> AttentionCall:
        return AttentionCall(
            q=self.qp,
            k=self.kp,
            v=self.vp,
            layout=self.layout,
            softmax_scale=self.scale,
            skip_factor=None if config.threshold is None else config.threshold * self.layout.max_seqlen_kv,
            quant=QuantConfig(dtype_qk=config.quant) if config.quant else None,
            role="bench",
        )


def _configs(s: _Shape, settings: Settings) -> list[Config]:
    configs = [Config("dense")]
    for lam in settings.thresholds:
        configs.append(Config("skip", threshold=lam))
    for target in settings.target_skips:
        lam = threshold_for(s.crit, target)
        if lam is not None:
            configs.append(Config("skip", threshold=lam, target_skip=target))
    skips = [c for c in configs if c.kind == "skip"]
    configs += [Config("sage", quant=d) for d in SAGE_DTYPES]
    # SAGE and skip-softmax together, on the routes that serve both.
    configs += [Config("sage+skip", c.threshold, c.target_skip, d) for d in SAGE_DTYPES for c in skips]
    return configs


def _wanted(name: str, settings: Settings, baseline: str) -> bool:
    return name == baseline or not settings.only or name in settings.only


def run_shape(
    shape: Shape,
    settings: Settings,
    *,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    deadline: float = float("inf"),
    progress: Callable[[str], None] = lambda _: None,
) -> ShapeResult:
    """Everything for one shape; each measured item fails alone (its error goes into its row)."""
    device, dtype = torch.device(settings.device), getattr(torch, settings.dtype)
    if qkv is None:
        qkv = structured_qkv(shape, settings.locality, seed=settings.seed, device=device, dtype=dtype)
    q, k, v = (x.to(device=device, dtype=dtype) for x in qkv)
    progress(f"{shape.name}: reference")
    s = _Shape(q, k, v, settings)
    result = ShapeResult(asdict(shape), s.heads, s.tile)
    result.skip_curve = {f"{lam:.3g}": skipped_fraction(s.crit, lam) for lam in (1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 0.3)}
    configs = _configs(s, settings)
    refs: dict[str, tuple[float | None, float | None]] = {}
    for cfg in configs:
        if cfg.kind == "dense":
            continue
        try:
            r = s.reference(cfg.threshold, cfg.quant)
            skipped = r.skipped_fraction if cfg.threshold is not None else None
            refs[cfg.label] = (skipped, rel_l1(r.out.float(), s.ref))
        except Exception as err:
            refs[cfg.label] = (None, None)
            result.not_run[f"reference {cfg.label}"] = f"{type(err).__name__}: {err}"

    flops = shape.flops()
    baseline_name = BASELINE_CUDA if device.type == "cuda" else BASELINE_CPU
    baseline_ms: float | None = None

    def measure(impl: str, cfg: Config, fn: Callable[[], torch.Tensor]) -> None:
        nonlocal baseline_ms
        row = Row(shape.name, impl, cfg.label, cfg.threshold, cfg.target_skip, cfg.quant)
        row.skipped_ref, row.ref_rel_l1 = refs.get(cfg.label, (None, None))
        if row.skipped_ref is not None:
            row.ideal_speedup = 1.0 / (1.0 - row.skipped_ref / 2.0)
        if time.monotonic() > deadline:
            row.error = "not run: time limit reached"
            result.rows.append(row)
            return
        progress(f"{shape.name}: {impl} {cfg.label}")
        try:
            with torch.no_grad():
                out = fn()
                row.rel_l1, row.cosine = s.accuracy(out)
                del out
                t: Timing = time_fn(
                    fn, device, warmup=settings.warmup, iters=settings.iters, max_seconds=settings.max_seconds
                )
            row.ms, row.iters = t.median_ms, t.iters
            row.tflops = flops / (t.median_ms * 1e-3) / 1e12
            if impl == baseline_name:
                baseline_ms = t.median_ms
            if baseline_ms:
                row.vs_baseline = baseline_ms / t.median_ms
        except Exception as err:
            row.error = f"{type(err).__name__}: {str(err)[:400]}"
        result.rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # External kernels, the baseline first (and again at the end: the faster of the two is used).
    externals = external_impls(device, dtype)
    for name, (factory, reason) in externals.items():
        if not _wanted(name, settings, baseline_name):
            continue
        if reason:
            result.not_run[name] = reason
            continue
        try:
            fn = factory(q, k, v, s.scale)
        except Exception as err:
            result.not_run[name] = f"{type(err).__name__}: {err}"
            continue
        measure(name, Config("dense"), fn)
        del fn

    # Our routes, generically: every registered route on every configuration it can serve.
    routes, load_error = available_routes()
    if load_error:
        result.not_run["route modules"] = load_error
    on_gpu = device.type == "cuda"
    for name, route in routes.items():
        if not _wanted(name, settings, baseline_name) or (on_gpu and not route.auto and name not in settings.only):
            continue
        for cfg in configs:
            call = s.call(cfg)
            reasons = route.not_supported_reasons(call)
            if reasons:
                result.not_run[f"{name} {cfg.kind}"] = "; ".join(reasons)
                continue
            measure(name, cfg, lambda r=route, c=call: r.run(c).out)
    # backend="auto": the route the library picks for dense and skip work.
    if _wanted("auto", settings, baseline_name):
        for cfg in configs:
            if cfg.quant:
                continue
            call = s.call(cfg)
            try:
                route = select_route(call)
            except Exception as err:
                result.not_run[f"auto {cfg.label}"] = f"{type(err).__name__}: {err}"
                continue
            measure(f"auto ({route.name})", cfg, lambda r=route, c=call: r.run(c).out)
    # The baseline again, so clock drift during the shape cannot favour later rows.
    first = baseline_ms
    measure(baseline_name, Config("dense"), externals[baseline_name][0](q, k, v, s.scale))
    result.rows[-1].impl = f"{baseline_name} (again)"
    if first and baseline_ms:
        baseline_ms = min(first, baseline_ms)
        for row in result.rows:
            row.vs_baseline = None if row.ms is None else baseline_ms / row.ms
    del s
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def warm_up(device: torch.device, seconds: float = 2.0) -> None:
    """Run matrix products for a while so the first timed kernel does not meet idle clocks."""
    if device.type != "cuda":
        return
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize(device)


def run_suite(
    shapes: list[Shape],
    settings: Settings,
    *,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    on_shape_done: Callable[[list[ShapeResult]], None] = lambda _: None,
    show_progress: bool = True,
) -> list[ShapeResult]:
    """Run ``run_shape`` for each shape within ``settings.time_limit`` seconds; report after each shape."""
    from tqdm.auto import tqdm

    deadline = time.monotonic() + settings.time_limit
    warm_up(torch.device(settings.device))
    results: list[ShapeResult] = []
    bar = tqdm(total=len(shapes), disable=not show_progress, unit="shape")
    for shape in shapes:
        try:
            res = run_shape(shape, settings, qkv=qkv, deadline=deadline, progress=bar.set_description)
        except Exception as err:  # inputs or reference failed: record and go on
            res = ShapeResult(asdict(shape), [], (0, 0), not_run={"shape": f"{type(err).__name__}: {err}"})
        results.append(res)
        on_shape_done(results)
        bar.update(1)
    bar.close()
    return results
