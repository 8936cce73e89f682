"""End-to-end benchmark: one transformer forward of full-size models, stock Diffusers against each processor setting.

``python -m diffusers_trtllm.bench e2e --help``. Per model (built once from its
published config with random weights, see :mod:`.models`), per weights kind
(``random``; ``structured``: local self-attention from ``locality.local_attention``)
and per mode (eager; ``--compile``): the stock forward (Diffusers with cuDNN SDPA)
is run and timed first, then every processor setting is installed on the same
model, run once for its output and routes, and timed; the stock forward is timed
again at the end and the faster of the two stock times is the baseline. Between
settings the stock processors are put back, so every setting starts from stock.

The skipped fraction is the reference's: the stock eager forward records, on a
sample of self/joint attention calls and heads, every tile's critical threshold
(``timing.tile_criticals``, fmha-v2's tiles), which gives the fraction skipped at
any threshold without running anything again. Routes that count skipped tiles
(``collect_stats``) also report their own count (``skipped_route``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from ..locality import local_attention
from ..measure import rel_l1, skipped_fraction, threshold_for, tile_criticals
from ..serving.roles import guess_role
from .cli import add_common_args, floats, names
from .inputs import spy_sdpa
from .models import MODELS, ModelSpec, build_model, model_inputs
from .suite import heads_subset, reference_tile, warm_up
from .timing import time_fn

__all__ = ["ProcessorSetting", "SETTINGS", "E2EOptions", "E2ERow", "ModelResult", "run_e2e", "probe", "format_probe",
           "ProcessorSummary", "processor_summary", "main"]

log = logging.getLogger("diffusers_trtllm.bench")

#: The skip settings' threshold; each model's default structured contrast (``ModelSpec.contrast``)
#: skips about half the self-attention tiles at it (``--probe``, benchmarks/README.md).
DEFAULT_THRESHOLD = 0.05
PROBE_CONTRASTS = (0.0, 16.0, 32.0, 48.0, 64.0)
PROBE_THRESHOLDS = (1e-3, 3e-3, 1e-2, 3e-2, 5e-2, 0.1, 0.2, 0.3)
PROBE_TARGETS = (0.4, 0.5, 0.6, 0.7)


@dataclass(frozen=True)
class ProcessorSetting:
    """One row's attention: stock Diffusers, or ``TrtllmAttnProcessor`` with SAGE and/or skip-softmax."""

    name: str
    quant: str | None = None
    #: SAGE's ``smooth_k`` (K's per-channel mean subtracted before quantizing; None: the library's default, on).
    smooth_k: bool | None = None
    #: SAGE's ``k_block_size`` (None: the library's default).
    k_block: int | None = None
    #: SAGE's ``k_per_thread`` (None: the library's default).
    k_per_thread: bool | None = None
    skip: bool = False
    stock: bool = False
    #: The processor's ``policy``: "always" shows what a request gives where "auto" declines it.
    policy: str = "auto"
    #: Skip-softmax by a calibrated ``target_sparsity`` (what a user who calibrates runs) instead of a
    #: bare threshold; the bench fits the curve to the stock forward's tiles (``calibration_for``).
    target_sparsity: float | None = None
    #: Stock Diffusers processors on one of Diffusers' own attention backends
    #: (``model.set_attention_backend``): what a user runs without this library, e.g. "sage".
    diffusers_backend: str | None = None
    #: The processor's ``fused_qk_norm`` (True: Diffusers' ``RMSNorm`` QK norms as our one launch).
    fused_qk_norm: bool = False

    def processor_kwargs(self, threshold: float, backend: str) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"backend": backend, "policy": self.policy}
        if self.fused_qk_norm:
            kwargs["fused_qk_norm"] = True
        if self.quant:
            quant: dict[str, Any] = {"dtype_qk": self.quant}
            if self.smooth_k is not None:
                quant["smooth_k"] = self.smooth_k
            if self.k_block is not None:
                quant["k_block_size"] = self.k_block
            if self.k_per_thread is not None:
                quant["k_per_thread"] = self.k_per_thread
            kwargs["quant"] = quant
        if self.target_sparsity is not None:
            kwargs.update(target_sparsity=self.target_sparsity, disabled_until_timestep=0.0)
        elif self.skip:
            kwargs.update(skip_softmax_threshold=threshold, disabled_until_timestep=0.0)
        return kwargs


SETTINGS: dict[str, ProcessorSetting] = {
    s.name: s
    for s in (
        ProcessorSetting("stock", stock=True),
        ProcessorSetting("dense"),
        ProcessorSetting("dense-fused-norm", fused_qk_norm=True),
        ProcessorSetting("stock-sage2", diffusers_backend="sage"),
        ProcessorSetting("sage-int8", quant="int8"),
        ProcessorSetting("sage-int8-always", quant="int8", policy="always"),
        ProcessorSetting("sage-int8-nosmooth", quant="int8", smooth_k=False),
        ProcessorSetting("sage-int8-k16", quant="int8", k_block=16),
        ProcessorSetting("sage-int8-k128", quant="int8", k_block=128),
        ProcessorSetting("sage-int8-k128-blocks", quant="int8", k_block=128, k_per_thread=False),
        ProcessorSetting("sage-fp8", quant="fp8_e4m3"),
        ProcessorSetting("skip", skip=True),
        ProcessorSetting("skip-always", skip=True, policy="always"),
        ProcessorSetting("skip-calibrated", skip=True, target_sparsity=0.5),
        ProcessorSetting("sage-int8+skip", quant="int8", skip=True),
        ProcessorSetting("sage-int8+skip-calibrated", quant="int8", skip=True, target_sparsity=0.5),
        ProcessorSetting("sage-fp8+skip", quant="fp8_e4m3", skip=True),
    )
}
WEIGHTS = ("random", "structured")
COMPILE_MODES = ("off", "full", "regional")


@dataclass
class E2EOptions:
    models: tuple[str, ...] = tuple(MODELS)
    configs: tuple[str, ...] = tuple(SETTINGS)
    weights: tuple[str, ...] = WEIGHTS
    #: Structured weights' contrast (nats, ``locality.local_attention``); None: each model's default.
    contrast: float | None = None
    threshold: float = DEFAULT_THRESHOLD
    #: When set, the skip threshold is the one at which the reference skips this fraction (per model).
    target_skip: float | None = None
    #: Normalized timestep of the forward (1 = noise); skip-softmax is on at every t here.
    t: float = 0.5
    backend: str = "auto"
    device: str = "cuda"
    dtype: str = "bfloat16"
    seed: int = 0
    warmup: int = 1
    iters: int = 3
    compile: str = "off"
    compile_backend: str = "inductor"
    eager: bool = True
    #: SDPA kernel of the stock forward on CUDA: "cudnn" (preferred, others as fallback) or torch's "default".
    stock_sdpa: str = "cudnn"
    ref_layers: int = 4
    ref_heads: int = 4
    #: "full" (published configs), "tiny" (CPU tests) or "probe" (one block, two heads, full geometry).
    variant: str = "full"
    time_limit: float = math.inf
    #: Rounds of stock and each setting timed back to back after the pass; ``vs_stock`` is then the median of the
    #: rounds' ratios (0: stock's faster timing over the setting's one), which clock drift cannot favour.
    alternate: int = 0


@dataclass
class E2ERow:
    model: str
    weights: str
    config: str
    compiled: bool
    threshold: float | None = None
    ms: float | None = None
    iters: int | None = None
    vs_stock: float | None = None
    #: Each alternating round's stock time over this row's (``E2EOptions.alternate``).
    vs_stock_rounds: list[float] = field(default_factory=list)
    rel_l1: float | None = None
    #: Reference's skipped-tile fraction of the self/joint calls at ``threshold`` (0 when they ran dense).
    skipped: float | None = None
    #: Skipped tiles / tiles over the calls whose route counted them (``collect_stats``), eager only.
    skipped_route: float | None = None
    #: Attention role -> routes its calls took (``+skip``: skip-softmax on; ``+sage``: quantized).
    routes: dict[str, str] = field(default_factory=dict)
    #: Attention role -> what the processor's policy dropped from the request, and why.
    policy: dict[str, str] = field(default_factory=dict)
    error: str | None = None


@dataclass
class ModelResult:
    model: str
    description: str
    build_s: float | None = None
    #: Contrast of the structured weights (nats).
    contrast: float | None = None
    #: Weights kind -> threshold ("%.3g") -> reference's skipped fraction of the sampled self/joint calls.
    skip_curve: dict[str, dict[str, float]] = field(default_factory=dict)
    #: Weights kind -> skip settings' threshold.
    threshold: dict[str, float | None] = field(default_factory=dict)
    error: str | None = None


class ProcessorSummary(NamedTuple):
    """What a processor's records say about the calls it served."""

    #: Attention role -> routes its calls took (``+skip`` / ``+sage``: that feature ran).
    routes: dict[str, str]
    #: Attention role -> what the processor's policy dropped from the request, and why.
    policy: dict[str, str]
    #: Skipped tiles / tiles over the skip-softmax calls (None: a route ran one without counting).
    skipped_route: float | None
    #: Whether any self/joint attention call ran with skip-softmax.
    sparse_self: bool


def processor_summary(proc: Any) -> ProcessorSummary:
    """Summarize ``proc``'s per-layer records.

    The one place that reads ``proc.layers[i].role`` and ``.records`` (fields ``route``,
    ``sparse``, ``sage``, ``skipped_tiles``, ``total_tiles``, ``note``).
    """
    routes: dict[str, set[str]] = {}
    notes: dict[str, set[str]] = {}
    skipped = tiles = 0
    sparse_self = uncounted = False
    for layer in proc.layers:
        for rec in layer.records:
            label = rec.route + ("+skip" if rec.sparse else "") + ("+sage" if rec.sage else "")
            routes.setdefault(layer.role, set()).add(label)
            note = getattr(rec, "note", None)
            if note:
                notes.setdefault(layer.role, set()).add(note)
            sparse_self |= rec.sparse and layer.role != "cross"
            if rec.total_tiles:
                skipped += rec.skipped_tiles or 0
                tiles += rec.total_tiles
            else:
                uncounted |= rec.sparse  # e.g. fmha-v2, whose kernels do not count skipped tiles

    def joined(by_role: dict[str, set[str]], sep: str) -> dict[str, str]:
        return {role: sep.join(sorted(v)) for role, v in sorted(by_role.items())}

    # A count over only some of the skip-softmax calls (cross-attention's, say) would pass for the whole.
    fraction = skipped / tiles if tiles and not uncounted else None
    return ProcessorSummary(joined(routes, ","), joined(notes, "; "), fraction, sparse_self)


class _Enough(Exception):
    """Raised by the probe's SDPA spy once it has what it needs, to stop the forward."""


class _SkipStatistics:
    """SDPA spy: tile criticals of every ``every``-th self/joint call (queries == keys) on a heads subsample. Calls
    over text alone (``text_tokens`` or fewer: HunyuanVideo's text refiner) are not the video's and are left out."""

    def __init__(self, every: int, max_calls: int, heads: int, stop: bool = False, text_tokens: int = 0) -> None:
        self.every, self.max_calls, self.heads, self.stop = max(every, 1), max_calls, heads, stop
        self.text_tokens = text_tokens
        self.self_calls = 0
        self.kv_len = 0
        self.crits: list[torch.Tensor] = []

    def __call__(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if q.shape[-2] != k.shape[-2] or k.shape[-2] <= self.text_tokens or len(self.crits) >= self.max_calls:
            return
        i, self.self_calls = self.self_calls, self.self_calls + 1
        if i % self.every:
            return
        self.kv_len = k.shape[-2]
        idx = torch.tensor(heads_subset(q.shape[1], self.heads), device=q.device)
        qs, ks = (x[0].index_select(0, idx).transpose(0, 1) for x in (q, k))  # [tokens, heads, dim]
        self.crits.append(tile_criticals(qs, ks, q.shape[-1] ** -0.5, *reference_tile(q.shape[-1])))
        if self.stop and len(self.crits) >= self.max_calls:
            raise _Enough

    def criticals(self) -> torch.Tensor | None:
        return torch.cat(self.crits, dim=0) if self.crits else None


def _self_attention_calls(model: torch.nn.Module) -> int:
    """Self/joint attention modules of ``model`` (calls per forward whose queries are the keys; text refiners not
    counted)."""
    count = 0
    for key in model.attn_processors:
        name = key.removesuffix(".processor")
        count += guess_role(name, model.get_submodule(name)) not in ("cross", "refiner")
    return count


def _skip_curve(crit: torch.Tensor | None) -> dict[str, float]:
    return {} if crit is None else {f"{lam:.3g}": skipped_fraction(crit, lam) for lam in PROBE_THRESHOLDS}


def calibration_for(crit: torch.Tensor, kv_len: int, target: float) -> tuple[dict[str, Any], float] | None:
    """A ModelOpt ``sparse_attention_config`` whose curve passes through the reference's factors at
    ``target`` +- 0.1 on the stock forward's tiles, and its threshold at ``target``; None when these
    weights cannot reach ``target + 0.1`` at any threshold up to 1 (flat attention: nothing to calibrate).

    A stand-in for ``calibrate()``, which needs a pipeline: the same curve ``factor = a * exp(b * s)``,
    fitted to one forward instead of a run over prompts and steps.
    """
    from ..calibration.checkpoint import sparse_attention_config

    low, high = target - 0.1, target + 0.1
    lam_low, lam_high = threshold_for(crit, low), threshold_for(crit, high)
    if lam_low is None or lam_high is None:
        return None
    b = math.log(lam_high / lam_low) / (high - low)
    a = lam_low * kv_len * math.exp(-b * low)
    config = sparse_attention_config([("self_attention", a, b, None, None)], target_sparsity=target)
    return config, a * math.exp(b * target) / kv_len


def stock_sdpa_context(choice: str, device: torch.device) -> contextlib.AbstractContextManager:
    """cuDNN first for torch SDPA (others kept as fallback) on CUDA; nothing elsewhere or for ``default``."""
    if device.type != "cuda" or choice == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class _ModelBench:
    """One built model with its inputs: runs and times every setting on it."""

    def __init__(self, spec: ModelSpec, opts: E2EOptions, result: ModelResult, rows: list[E2ERow]) -> None:
        self.spec, self.opts, self.result, self.rows = spec, opts, result, rows
        self.device, self.dtype = torch.device(opts.device), getattr(torch, opts.dtype)
        start = time.monotonic()
        self.model = build_model(spec, device=self.device, dtype=self.dtype, seed=opts.seed, variant=opts.variant)
        self.inputs = model_inputs(spec, self.model, t=opts.t, device=self.device, dtype=self.dtype, seed=opts.seed,
                                   tiny=opts.variant == "tiny")
        self.text_tokens = spec.text_tokens_of(opts.variant == "tiny")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        result.build_s = time.monotonic() - start
        self.stock = dict(self.model.attn_processors)
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

        #: Diffusers' process-wide attention backend, and its backend set on the model now (``stock-sage2``).
        self.default_backend = _AttentionBackendRegistry.get_active_backend()[0]
        self.diffusers_backend: str | None = None
        self.runner: Callable[..., Any] = self.model
        self.crits: dict[str, torch.Tensor | None] = {}
        #: Self-attention KV length of each weights kind's recorded calls (the calibration's ``kv_len``).
        self.kv_lens: dict[str, int] = {}
        #: One processor per (setting, threshold), installed again on later passes: the same objects
        #: let torch.compile reuse its graphs instead of recompiling.
        self.processors: dict[tuple[str, float], Any] = {}

    def forward(self) -> torch.Tensor:
        with torch.no_grad(), stock_sdpa_context(self.opts.stock_sdpa, self.device):
            return self.runner(**self.inputs)[0]

    def time(self) -> tuple[float, int]:
        t = time_fn(self.forward, self.device, warmup=self.opts.warmup, iters=self.opts.iters, max_seconds=3600.0)
        return t.median_ms, t.iters

    def use_diffusers_backend(self, backend: str | None) -> None:
        """Diffusers' attention backend ``backend`` on the stock processors, or (None) its default back.
        ``set_attention_backend`` also makes the backend process-wide active (Diffusers' private registry),
        which ``reset_attention_backend`` leaves as it is: that is put back too, or later stock forwards
        would run it."""
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

        if backend is not None:
            self.model.set_attention_backend(backend)
        elif self.diffusers_backend is not None:
            self.model.reset_attention_backend()
            _AttentionBackendRegistry.set_active_backend(self.default_backend)
        self.diffusers_backend = backend

    def install(self, setting: ProcessorSetting, threshold: float, collect_stats: bool = False,
                calibration: dict[str, Any] | None = None) -> Any:
        """Stock processors and Diffusers' default attention back, then (unless stock) Diffusers' backend of
        ``setting`` (returns None) or its processor with empty records and ``calibration`` loaded (returns it)."""
        from .. import TrtllmAttnProcessor, install, load_calibration

        self.model.set_attn_processor(dict(self.stock))  # Diffusers pops from the dict
        self.use_diffusers_backend(setting.diffusers_backend)
        if setting.stock or setting.diffusers_backend is not None:
            return None
        key = (setting.name, threshold)
        proc = None if collect_stats else self.processors.get(key)
        if proc is None:
            proc = TrtllmAttnProcessor(**setting.processor_kwargs(threshold, self.opts.backend), collect_stats=collect_stats)
            if not collect_stats:
                self.processors[key] = proc
        install(self.model, proc)  # binds every layer now: a processor put back would bind them at its first forward
        if calibration is not None:
            load_calibration(self.model, calibration)
        proc.reset_stats()
        proc.set_timestep(self.opts.t)
        return proc

    def compile(self) -> None:
        opts = self.opts
        # One graph set per setting, kept for the next weights kind and the stock timing at the end.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        if opts.compile == "regional":
            # Each block names its layer with an int attribute; without this every block recompiles.
            torch._dynamo.config.allow_unspec_int_on_nn_module = True
            self.model.compile_repeated_blocks(backend=opts.compile_backend)
        else:
            self.runner = torch.compile(self.model, backend=opts.compile_backend)

    def run_pass(self, weights: str, compiled: bool, deadline: float, tick: Callable[[], None]) -> None:
        """Every configured setting once, for one weights kind and mode; rows are appended as they finish."""
        opts, spec = self.opts, self.spec
        settings = [SETTINGS[name] for name in opts.configs]
        stock_setting = SETTINGS["stock"]
        if stock_setting not in settings:
            settings.insert(0, stock_setting)
        pass_rows: list[E2ERow] = []
        #: Each timed setting row and how it was installed (setting, threshold, calibration), for the alternating rounds.
        installed: list[tuple[E2ERow, ProcessorSetting, float, dict[str, Any] | None]] = []
        stock_out: torch.Tensor | None = None
        stock_ms: list[float] = []
        threshold = self.result.threshold.get(weights, opts.threshold)
        for setting in settings:
            row = E2ERow(spec.name, weights, setting.name, compiled, threshold if setting.skip else None)
            pass_rows.append(row)
            self.rows.append(row)
            if time.monotonic() > deadline:
                row.error = "not run: time limit reached"
                tick()
                continue
            try:
                if setting.stock:
                    self.install(setting, threshold)
                    if compiled or weights in self.crits:
                        stock_out = self.forward()
                    else:
                        stats = _SkipStatistics(
                            _self_attention_calls(self.model) // max(opts.ref_layers, 1), opts.ref_layers, opts.ref_heads,
                            text_tokens=self.text_tokens,
                        )
                        with spy_sdpa(stats):
                            stock_out = self.forward()
                        crit = self.crits[weights] = stats.criticals()
                        self.kv_lens[weights] = stats.kv_len
                        self.result.skip_curve[weights] = _skip_curve(crit)
                        if opts.target_skip is not None and crit is not None:
                            threshold = threshold_for(crit, opts.target_skip) or opts.threshold
                        self.result.threshold[weights] = threshold
                    row.ms, row.iters = self.time()
                    row.rel_l1 = 0.0
                    stock_ms.append(row.ms)
                else:
                    calibration = self._run_setting(row, setting, threshold, compiled, stock_out)
                    if row.ms is not None:
                        installed.append((row, setting, row.threshold or threshold, calibration))
            except Exception as err:  # one failing setting must not stop the others
                row.error = f"{type(err).__name__}: {str(err)[:400]}"
                log.warning("%s %s %s: %s", spec.name, weights, setting.name, row.error)
            finally:
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()  # gc.collect() per setting costs ~0.3 s with Diffusers loaded
            tick()
        # The stock forward again, so clock drift during the pass cannot favour later rows.
        if stock_ms and time.monotonic() <= deadline:
            try:
                self.install(stock_setting, threshold)
                stock_ms.append(self.time()[0])
            except Exception as err:
                log.warning("%s %s stock (again): %s", spec.name, weights, err)
        if stock_ms:
            base = min(stock_ms)
            for row in pass_rows:
                row.vs_stock = None if row.ms is None else base / row.ms
        if stock_ms and self.opts.alternate > 0:
            self._alternate(installed, stock_setting, deadline)
        self.model.set_attn_processor(dict(self.stock))  # Diffusers pops from the dict
        self.use_diffusers_backend(None)

    def _alternate(self, installed: list[tuple[E2ERow, ProcessorSetting, float, dict | None]],
                   stock_setting: ProcessorSetting, deadline: float) -> None:
        """Each timed setting against stock in ``opts.alternate`` rounds, stock first in each, and its ``vs_stock``
        the median of the rounds' ratios (within the time limit: rows without a round keep theirs)."""
        for row, setting, threshold, calibration in installed:
            for _ in range(self.opts.alternate):
                if time.monotonic() > deadline:
                    break
                self.install(stock_setting, threshold)
                stock_ms = self.time()[0]
                self.install(setting, threshold, calibration=calibration)
                row.vs_stock_rounds.append(stock_ms / self.time()[0])
            if row.vs_stock_rounds:
                row.vs_stock = statistics.median(row.vs_stock_rounds)

    def _run_setting(self, row: E2ERow, setting: ProcessorSetting, threshold: float, compiled: bool,
                     stock_out: torch.Tensor | None) -> dict[str, Any] | None:
        """Install, check and time one setting into ``row``; returns the calibration it loaded (None: none)."""
        calibration = None
        if setting.target_sparsity is not None:
            crit = self.crits.get(row.weights)
            fitted = None if crit is None else calibration_for(crit, self.kv_lens[row.weights], setting.target_sparsity)
            if fitted is None:
                row.error = (f"not run: no threshold up to 1 skips {setting.target_sparsity + 0.1:.0%} of these weights' "
                             "tiles, so there is no curve to calibrate")
                return None
            calibration, threshold = fitted
            row.threshold = threshold
        # Eager: the output forward also counts skipped tiles where a route can (a sync per call, so not timed).
        proc = self.install(setting, threshold, collect_stats=setting.skip and not compiled, calibration=calibration)
        out = self.forward()
        if stock_out is not None:
            row.rel_l1 = rel_l1(out.float(), stock_out.float())
        del out
        if proc is None:  # Diffusers' own backend: no records of ours
            row.routes = {"all": f"diffusers {setting.diffusers_backend}"}
            row.ms, row.iters = self.time()
            return None
        summary = processor_summary(proc)
        row.routes, row.policy, row.skipped_route = summary.routes, summary.policy, summary.skipped_route
        crit = self.crits.get(row.weights)
        if setting.skip and crit is not None:
            row.skipped = skipped_fraction(crit, threshold) if summary.sparse_self else 0.0
        if setting.skip and not compiled:
            self.install(setting, threshold, calibration=calibration)  # timed without the counting
        row.ms, row.iters = self.time()
        return calibration

    def close(self) -> None:
        self.model.set_attn_processor(dict(self.stock))  # Diffusers pops from the dict
        self.use_diffusers_backend(None)
        del self.model, self.runner, self.inputs
        if self.opts.compile != "off":
            torch._dynamo.reset()
        _free(self.device)


def run_e2e(
    opts: E2EOptions,
    *,
    on_item_done: Callable[[list[ModelResult], list[E2ERow]], None] = lambda *_: None,
    show_progress: bool = True,
) -> tuple[list[ModelResult], list[E2ERow]]:
    """Every model x weights kind x mode x setting within ``opts.time_limit`` seconds; report after each item."""
    from tqdm.auto import tqdm

    _check(opts)
    deadline = time.monotonic() + opts.time_limit
    device = torch.device(opts.device)
    warm_up(device)
    modes = ([False] if opts.eager else []) + ([True] if opts.compile != "off" else [])
    configs = len(set(opts.configs) | {"stock"})
    bar = tqdm(total=len(opts.models) * len(opts.weights) * len(modes) * configs, disable=not show_progress, unit="item")
    results: list[ModelResult] = []
    rows: list[E2ERow] = []

    def tick() -> None:
        bar.update(1)
        on_item_done(results, rows)

    for name in opts.models:
        spec = MODELS[name]
        result = ModelResult(name, spec.describe(opts.variant), contrast=opts.contrast or spec.contrast)
        results.append(result)
        if time.monotonic() > deadline:
            result.error = "not run: time limit reached"
            bar.update(len(opts.weights) * len(modes) * configs)
            on_item_done(results, rows)
            continue
        bar.set_description(f"{name}: build")
        try:
            bench = _ModelBench(spec, opts, result, rows)
        except Exception as err:
            result.error = f"{type(err).__name__}: {str(err)[:400]}"
            log.warning("%s: %s", name, result.error)
            bar.update(len(opts.weights) * len(modes) * configs)
            on_item_done(results, rows)
            _free(device)
            continue
        try:
            for compiled in modes:
                if compiled:
                    bench.compile()
                for weights in opts.weights:
                    bar.set_description(f"{name}: {weights}{' compiled' if compiled else ''}")
                    structure = (local_attention(bench.model, result.contrast, seed=opts.seed) if weights == "structured"
                                 else contextlib.nullcontext())
                    with structure:
                        bench.run_pass(weights, compiled, deadline, tick)
        finally:
            bench.close()
    bar.close()
    return results, rows


def _check(opts: E2EOptions) -> None:
    for label, values, known in (("models", opts.models, MODELS), ("configs", opts.configs, SETTINGS),
                                 ("weights", opts.weights, WEIGHTS)):
        unknown = [v for v in values if v not in known]
        if unknown:
            raise ValueError(f"unknown {label} {unknown}; choose from {', '.join(known)}.")
    if opts.compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}; got {opts.compile!r}.")
    if not opts.eager and opts.compile == "off":
        raise ValueError("--no-eager leaves nothing to run without --compile full|regional.")
    if opts.variant not in ("full", "tiny", "probe"):
        raise ValueError(f"variant must be 'full', 'tiny' or 'probe'; got {opts.variant!r}.")
    if not 0.0 <= opts.t <= 1.0:
        raise ValueError(f"t is a normalized timestep in [0, 1]; got {opts.t!r}.")


def probe(
    models: tuple[str, ...],
    contrasts: tuple[float, ...],
    *,
    device: str = "cpu",
    dtype: str = "bfloat16",
    seed: int = 0,
    ref_heads: int = 4,
    t: float = 0.5,
    variant: str = "probe",
) -> dict[str, dict[str, Any]]:
    """Skipped fraction per threshold of each model's structured self-attention, without a GPU.

    Builds the ``probe`` variant (one block, two heads, the published head dim, RoPE
    and token grid), makes its attention local with each ``contrast`` (0: random
    weights), runs the forward up to the first self/joint attention call and
    computes that call's tile criticals. Returns ``{model: {contrast: {"curve":
    {threshold: fraction}, "thresholds": {target: threshold}}}}``.
    """
    out: dict[str, dict[str, Any]] = {}
    torch_dtype = getattr(torch, dtype)
    for name in models:
        spec = MODELS[name]
        model = build_model(spec, device=device, dtype=torch_dtype, seed=seed, variant=variant)
        inputs = model_inputs(spec, model, t=t, device=device, dtype=torch_dtype, seed=seed, tiny=variant == "tiny")
        out[name] = {}
        for contrast in contrasts:
            stats = _SkipStatistics(1, 1, ref_heads, stop=True, text_tokens=spec.text_tokens_of(variant == "tiny"))
            structure = local_attention(model, contrast, seed=seed) if contrast > 0 else contextlib.nullcontext()
            with structure, spy_sdpa(stats), torch.no_grad(), contextlib.suppress(_Enough):
                model(**inputs)
            crit = stats.criticals()
            out[name][f"{contrast:g}"] = {
                "curve": _skip_curve(crit),
                "thresholds": {f"{s:.0%}": None if crit is None else threshold_for(crit, s) for s in PROBE_TARGETS},
            }
        del model
        _free(torch.device(device))
    return out


def format_probe(data: dict[str, dict[str, Any]]) -> str:
    lines = []
    for name, by_contrast in data.items():
        lines.append(f"{name}: skipped fraction of self/joint tiles by threshold (columns), per contrast (rows)")
        lines.append(f"{'contrast':>8}  " + "  ".join(f"{lam:>6.3g}" for lam in PROBE_THRESHOLDS)
                     + "   threshold for " + ", ".join(f"{s:.0%}" for s in PROBE_TARGETS))
        for contrast, d in by_contrast.items():
            curve = "  ".join(f"{d['curve'].get(f'{lam:.3g}', math.nan):6.1%}" for lam in PROBE_THRESHOLDS)
            targets = ", ".join("-" if v is None else f"{v:.3g}" for v in d["thresholds"].values())
            lines.append(f"{contrast:>8}  {curve}   {targets}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m diffusers_trtllm.bench e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=names, default=tuple(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--configs", type=names, default=tuple(SETTINGS),
                   help=f"processor settings, from {', '.join(SETTINGS)} (stock always runs)")
    p.add_argument("--weights", type=names, default=WEIGHTS, help="random and/or structured (local self-attention)")
    p.add_argument("--contrast", type=floats, default=None,
                   help="structured weights' score contrast in nats (locality.local_attention; default: per model); "
                        f"a list with --probe (default {','.join(f'{c:g}' for c in PROBE_CONTRASTS)})")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="skip-softmax threshold of the skip settings")
    p.add_argument("--target-skip", type=float, default=None,
                   help="instead: per model and weights, the threshold at which the reference skips this fraction")
    p.add_argument("--t", type=float, default=0.5, help="normalized timestep of the forward (skip is on at any t)")
    p.add_argument("--backend", default="auto", help="the processor's backend (route name or auto)")
    p.add_argument("--compile", nargs="?", const="full", default="off", choices=COMPILE_MODES,
                   help="also time under torch.compile: whole model (full, the default of --compile) or repeated "
                        "blocks (regional)")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--no-eager", action="store_true", help="only the compiled rows")
    p.add_argument("--stock-sdpa", default="cudnn", choices=["cudnn", "default"])
    p.add_argument("--variant", default=None, choices=["full", "tiny", "probe"],
                   help="published configs (full, the default), tiny ones (CPU tests), or one block and two heads at "
                        "full geometry (probe: a quick GPU check, and the default of --probe)")
    p.add_argument("--tiny", action="store_const", const="tiny", dest="variant", help="--variant tiny")
    p.add_argument("--probe", action="store_true",
                   help="print the structured weights' skipped fraction per threshold (one reduced forward; CPU is fine)")
    add_common_args(p, "e2e", "NAME.json, NAME.md")
    p.add_argument("--warmup", type=int, default=1, help="untimed forwards after the output forward")
    p.add_argument("--iters", type=int, default=3, help="timed forwards (median)")
    p.add_argument("--ref-layers", type=int, default=4, help="self/joint attention calls sampled for the skip statistics")
    p.add_argument("--ref-heads", type=int, default=4, help="heads per sampled call")
    p.add_argument("--time-limit", type=float, default=math.inf, help="stop starting new items after this many seconds")
    p.add_argument("--alternate", type=int, default=0, metavar="N",
                   help="then time stock and each setting back to back N times; vs stock: the rounds' median ratio")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Path | None:
    """``python -m diffusers_trtllm.bench e2e ARGV``; returns the JSON's path (None with ``--probe``)."""
    from .report import environment, write_e2e_json, write_e2e_markdown

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.probe:
        print(format_probe(probe(args.models, args.contrast or PROBE_CONTRASTS, device=args.device, dtype=args.dtype,
                                 seed=args.seed, ref_heads=args.ref_heads, t=args.t, variant=args.variant or "probe")))
        return None
    if args.contrast is not None and len(args.contrast) != 1:
        raise SystemExit("--contrast takes one value outside --probe.")
    opts = E2EOptions(
        models=args.models, configs=args.configs, weights=args.weights,
        contrast=args.contrast[0] if args.contrast else None,
        threshold=args.threshold, target_skip=args.target_skip, t=args.t, backend=args.backend, device=args.device,
        dtype=args.dtype, seed=args.seed, warmup=args.warmup, iters=args.iters, compile=args.compile,
        compile_backend=args.compile_backend, eager=not args.no_eager, stock_sdpa=args.stock_sdpa,
        ref_layers=args.ref_layers, ref_heads=args.ref_heads, variant=args.variant or "full", time_limit=args.time_limit,
        alternate=args.alternate,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment(args.device, ["e2e", *argv])
    stem = args.out / args.name

    def save(results: list[ModelResult], rows: list[E2ERow]) -> None:  # after every item: a cut run keeps its rows
        write_e2e_json(stem.with_suffix(".json"), env, opts, results, rows)
        write_e2e_markdown(stem.with_suffix(".md"), env, opts, results, rows)

    results, rows = run_e2e(opts, on_item_done=save, show_progress=not args.no_progress)
    save(results, rows)
    return stem.with_suffix(".json")
