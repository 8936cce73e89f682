"""Sweep the ``sage-sm90`` kernel's builds beside cuDNN, SageAttention2 and the triton int8 route (H100/H200).

    python3 benchmarks/bench_sage_sm90.py --shapes wan_14b_480p,flux_1024 --out benchmarks/results/sage_sm90_sweep_h200.json
    DIFFUSERS_TRTLLM_CACHE=.cubin-cache python3 benchmarks/bench_sage_sm90.py --builds default,serial --build-only
        (on any machine with NVRTC or nvcc, no GPU needed: the cubins a GPU session then carries instead of compiling)
    python3 benchmarks/bench_sage_sm90.py --target-skips 0.1,0.2,0.3,0.4,0.5 --reach-spread 1 --no-triton-skip --out X.json
        (a skip curve: X.png beside X.json plots speed against the tiles the kernel skipped)

``--nvcc PATH`` adds rows of the default build compiled by that nvcc instead of NVRTC (the library's compiler
where no ``$DIFFUSERS_TRTLLM_NVCC`` is set), to compare the two compilers' kernels in one run.

``--kernel-only-builds`` adds a "kernel only" row (the kernel on the quantizer's output, the quantizer's time left
out) for every build, not only the default, and with ``--alternate-builds`` times each against the default's
kernel in alternating rounds: the persistent kernel against one CTA per work tile, for example,

    python3 benchmarks/bench_sage_sm90.py --shapes flux_1024,flux_2048=1:16896:24:128,wan_14b_480p \
        --builds default,persistent,persistent-1q --quants k128t-smooth --target-skips "" --kernel-only-builds \
        --alternate-builds --out benchmarks/results/sage_sm90_persistent_h100.json

or CTAs of one consumer warpgroup, two an SM, with ``--builds default,one_consumer,one_consumer_persistent``.

``--quants k16,k128-smooth`` runs the kernel's rows per SAGE setting (``QUANTS``: K blocks of 16 or 128 keys,
with or without ``smooth_k``, ``t``: split per thread); rows of settings other than ``k16`` carry the setting's
name after the build's.

Whole calls (quantization included), structured inputs (locality 0.5 unless ``--locality``), median CUDA-event time; speed is a
ratio to cuDNN SDPA timed in the same run on the same inputs; rel-L1 / cosine against fp32 dense attention
on a subset of heads. The skip rows use the threshold at which the reference skips the target fraction of
this kernel's 64 x 128 tiles (``tile_criticals`` on the same heads).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from diffusers_trtllm.bench.inputs import parse_shapes, structured_qkv
from diffusers_trtllm.bench.suite import heads_subset
from diffusers_trtllm.bench.timing import time_fn
from diffusers_trtllm.config import QuantConfig
from diffusers_trtllm.kernels.sage_sm90 import (BLOCK_M, BLOCK_N, VARIANTS, build_kernels, sage_sm90_attention,
                                                 sage_sm90_quantize)
from diffusers_trtllm.kernels.triton_attn import triton_attention
from diffusers_trtllm.layout import PackedLayout
from diffusers_trtllm.measure import cosine, rel_l1, threshold_for, tile_criticals

#: Compile-time variants of the kernel (``-D`` defines of ``csrc/sage_sm90.cu``), by name.
BUILDS = {
    "default": (),
    "serial-fp32-poly": ("SAGE_SM90_OVERLAP=0", "SAGE_SM90_HALF_POLY=0"),  # the default until 2026-12-01 night
    "serial": ("SAGE_SM90_OVERLAP=0",),
    "fp32-poly": ("SAGE_SM90_HALF_POLY=0",),
    "pingpong": ("SAGE_SM90_PINGPONG=1",),  # the default until 2026-12-03
    "2stages": ("SAGE_SM90_STAGES=2",),
    "mufu-only": ("SAGE_SM90_SOFT_EXP=0",),
    "softexp2": ("SAGE_SM90_SOFT_EXP=2",),
    "softexp6": ("SAGE_SM90_SOFT_EXP=6",),
    "softexp8": ("SAGE_SM90_SOFT_EXP=8",),
    "5stages": ("SAGE_SM90_STAGES=5",),
    "6stages": ("SAGE_SM90_STAGES=6",),
    "persistent": ("SAGE_SM90_PERSISTENT=1",),  # one CTA per SM looping over the work tiles (issue 57)
    "persistent-1q": ("SAGE_SM90_PERSISTENT=1", "SAGE_SM90_Q_BUFFERS=1"),  # the same with one Q buffer
    # CTAs of 64 query rows (one consumer warpgroup, three stages), two an SM; and those persistent
    "one_consumer": ("SAGE_SM90_CONSUMERS=1",),
    "one_consumer_persistent": ("SAGE_SM90_CONSUMERS=1", "SAGE_SM90_PERSISTENT=1"),
    "registers-out": ("SAGE_SM90_STAGE_OUT=0",),  # the output stored from the registers (the default until 2026-12-07)
    # O rescaled only where a row's max passed the exponent's by more than 1 / 2 (log2 units; issue 57)
    "slack1": ("SAGE_SM90_RESCALE_SLACK=1",),
    "slack2": ("SAGE_SM90_RESCALE_SLACK=2",),
}


#: SAGE settings the kernel's rows run with, by name ("k16" rows carry no suffix): K blocks of 16 or 128 keys,
#: ``t`` split per thread, ``-smooth`` with ``smooth_k`` (``k128t-smooth``: the route's default).
QUANTS = {
    "k16": QuantConfig("int8", 1, 16, smooth_k=False, k_per_thread=False),
    "k16-smooth": QuantConfig("int8", 1, 16, smooth_k=True, k_per_thread=False),
    "k16t": QuantConfig("int8", 1, 16, smooth_k=False, k_per_thread=True),
    "k128": QuantConfig("int8", 1, 128, smooth_k=False, k_per_thread=False),
    "k128-smooth": QuantConfig("int8", 1, 128, smooth_k=True, k_per_thread=False),
    "k128t": QuantConfig("int8", 1, 128, smooth_k=False, k_per_thread=True),
    "k128t-smooth": QuantConfig("int8", 1, 128, smooth_k=True, k_per_thread=True),
}


#: Skip factors that probe the skip build's costs: 0 (the route runs the kernel without skip: lambda = 0 can skip
#: nothing), tiny (the vote runs on every tile and skips none: what skip costs when nothing is skipped) and huge
#: (every tile after the first skipped: what a skipped tile costs).
SKIP_PROBES = {"+skip0": 0.0, "+skiptiny": 1e-30, "+skipall": 1e30}


def _compiled_by(nvcc: str, fn):
    """``fn`` with the kernel built by ``nvcc`` (``$DIFFUSERS_TRTLLM_NVCC``, which the library then prefers)."""
    def run():
        os.environ["DIFFUSERS_TRTLLM_NVCC"] = nvcc
        try:
            return fn()
        finally:
            del os.environ["DIFFUSERS_TRTLLM_NVCC"]
    return run


def run_shape(shape, builds, quants, targets, iters, locality, k_mean, v_mean, nvcc=None, reach_spread=0.0,
              with_triton_skip=True, alternate_skip=False, alternate_builds=False, rounds=8,
              on_row=lambda rows: None, kernel_only_builds=False) -> list[dict]:
    """The shape's rows, each handed to ``on_row`` (with the rows before it) as soon as it is measured."""
    dev = torch.device("cuda")
    q, k, v = (x[0].contiguous() for x in structured_qkv(shape, locality, device=dev, k_mean=k_mean, v_mean=v_mean,
                                                         reach_spread=reach_spread))
    layout = PackedLayout.dense(1, q.shape[0], k.shape[0], dev)
    scale = shape.head_dim**-0.5
    heads = heads_subset(shape.heads, 4)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        sub = [x[:, heads].float().transpose(0, 1)[None] for x in (q, k, v)]
        ref = F.scaled_dot_product_attention(*sub, scale=scale)[0].transpose(0, 1)
    crit = tile_criticals(q[:, heads], k[:, heads], scale, BLOCK_M, BLOCK_N)
    quant = QuantConfig("int8", 1, 16, smooth_k=False)
    qh, kh, vh = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qh, kh, vh, scale=scale)[0].transpose(0, 1)

    impls = {"cudnn": cudnn}
    try:
        import sageattention

        k_own = k.clone()[None]  # sageattn smooths K in place
        impls["sageattn"] = lambda: sageattention.sageattn(q[None], k_own, v[None], tensor_layout="NHD",
                                                           is_causal=False, sm_scale=scale)[0]
    except ImportError as err:
        print("sageattn unavailable:", err)
    # Skip factors at which the reference skips each target fraction of this kernel's tiles (None: unreachable).
    factors = {t: lam * layout.max_seqlen_kv for t in targets if (lam := threshold_for(crit, t)) is not None}
    at_targets = [(f"+skip{int(t * 100)}", f) for t, f in factors.items()]
    impls["triton-int8"] = lambda: triton_attention(q, k, v, layout, softmax_scale=scale, quant=quant).out
    for label, factor in at_targets if with_triton_skip else ():
        impls[f"triton-int8{label}"] = lambda f=factor: triton_attention(
            q, k, v, layout, softmax_scale=scale, quant=quant, skip_factor=f).out
    def quantize_only(qc: QuantConfig) -> None:  # (a row without an attention output)
        sage_sm90_quantize(q, k, v, layout, qc)

    counters = {}  # a skip row's call with the kernel's skipped-tile counter on (one more call, not timed)
    for qname, qc in quants.items():
        tag = "" if qname == "k16" else f"/{qname}"
        for name, defines in builds.items():
            for label, factor in [("", None), *SKIP_PROBES.items(), *at_targets]:
                call = functools.partial(sage_sm90_attention, q, k, v, layout, softmax_scale=scale, quant=qc,
                                         skip_factor=factor, defines=defines)
                impl = f"sage-sm90[{name}{tag}]{label}"
                impls[impl] = lambda call=call: call().out
                if factor is not None:
                    counters[impl] = functools.partial(call, collect_stats=True)
            if alternate_skip and name == "default":  # skip's gain or cost, clear of drift between rows
                skip_off = functools.partial(sage_sm90_attention, q, k, v, layout, softmax_scale=scale, quant=qc,
                                             defines=defines)
                # The same call against itself: the spread of these ratios is the timing's own, the yardstick for
                # the others.
                impls[f"sage-sm90[{name}{tag}]: skip off | skip off, alternating"] = Alternating(
                    lambda off=skip_off: off().out, lambda off=skip_off: off().out, rounds)
                for label in ["+skiptiny", *(label for label, _ in at_targets)]:
                    impl = f"sage-sm90[{name}{tag}]{label}"
                    impls[f"{impl}: skip off | skip on, alternating"] = Alternating(
                        lambda off=skip_off: off().out, impls[impl], rounds)
            if alternate_builds and name != "default":  # a build's gain or cost, clear of drift between rows
                for label in ["", "+skiptiny", "+skipall", *(label for label, _ in at_targets)]:
                    impls[f"sage-sm90[default{tag}] | [{name}{tag}]{label}, alternating"] = Alternating(
                        impls[f"sage-sm90[default{tag}]{label}"], impls[f"sage-sm90[{name}{tag}]{label}"], rounds)
        # Where a whole call's time goes (default build): the quantizer alone, the kernel alone on its output.
        quantized = sage_sm90_quantize(q, k, v, layout, qc)
        impls[f"sage-sm90{tag} quantizer only"] = functools.partial(quantize_only, qc)
        kernel_only = lambda qc=qc, st=quantized: sage_sm90_attention(  # noqa: E731
            q, k, v, layout, softmax_scale=scale, quant=qc, quantized=st).out
        impls[f"sage-sm90[default{tag}] kernel only"] = kernel_only
        for name, defines in builds.items() if kernel_only_builds else ():
            if name == "default":
                continue
            impl = f"sage-sm90[{name}{tag}] kernel only"
            impls[impl] = lambda qc=qc, st=quantized, d=defines: sage_sm90_attention(
                q, k, v, layout, softmax_scale=scale, quant=qc, quantized=st, defines=d).out
            if alternate_builds:  # the build's gain or cost on the kernel alone, clear of drift between rows
                impls[f"sage-sm90[default{tag}] | [{name}{tag}] kernel only, alternating"] = Alternating(
                    kernel_only, impls[impl], rounds)
        if nvcc and "default" in builds:
            for label, factor in [("", None), *at_targets]:
                impls[f"sage-sm90[default{tag}] nvcc{label}"] = _compiled_by(
                    nvcc, lambda f=factor, qc=qc: sage_sm90_attention(q, k, v, layout, softmax_scale=scale, quant=qc,
                                                                      skip_factor=f).out)
            impls[f"sage-sm90[default{tag}] kernel only: NVRTC | nvcc, alternating"] = Alternating(
                kernel_only, _compiled_by(nvcc, kernel_only), rounds)
    rows, base = [], None
    for name, fn in impls.items():
        try:
            out = fn()
            if isinstance(fn, Alternating):
                times, ratios = fn.time(dev, iters)
                t = times[0]
            else:
                times, t = None, time_fn(fn, dev, warmup=3, iters=iters, max_seconds=4.0).median_ms
        except Exception as err:  # report and go on: one broken build must not hide the others
            print(f"{shape.name} {name}: FAILED {type(err).__name__}: {err}")
            rows.append(dict(shape=shape.name, impl=name, error=f"{type(err).__name__}: {err}"))
            on_row(rows)
            continue
        base = base or t
        row = dict(shape=shape.name, impl=name, ms=t, vs_cudnn=base / t, tflops=shape.flops() / t / 1e9,
                   host_ms=host_ms(fn) if t < 5.0 else None)
        if times is not None:
            q1, median, q3 = statistics.quantiles(ratios, n=4)
            row.update(ms_second=times[1], second_vs_first=times[0] / times[1], round_ratios=ratios,
                       round_ratio_median=median, round_ratio_quartiles=[q1, q3])
        if out is not None:  # (the quantizer's row has no attention output)
            o = out.reshape(q.shape)[:, heads].float()
            row.update(rel_l1=rel_l1(o, ref), cosine=cosine(o, ref))
        if name in counters:
            res = counters[name]()
            row["skipped"] = res.skipped_tiles / res.total_tiles
        rows.append(row)
        on_row(rows)
        extra = f"  skipped {row['skipped']:.3f}" if "skipped" in row else ""
        if times is not None:
            extra += (f"  second {times[1]:.3f} ms (first / second time {times[0] / times[1]:.4f}; per round: median "
                      f"{row['round_ratio_median']:.4f}, middle half {q1:.4f}-{q3:.4f})")
        print(f"{shape.name:14s} {name:34s} {t:8.3f} ms {base / t:6.3f}x  rel-L1 {row.get('rel_l1', float('nan')):.4f}  "
              f"host {row['host_ms'] or float('nan'):.3f} ms{extra}", flush=True)
    return rows


class Alternating:
    """Two callables timed in alternating rounds (first, second, second, first, ...), so that a clock or thermal drift
    over the run weighs on both alike: each one's time is the median of its rounds' medians, and each round gives
    a paired ratio (first / second), whose spread says how far a ratio can be trusted."""

    def __init__(self, first, second, rounds: int = 8) -> None:
        self.first, self.second, self.rounds = first, second, rounds

    def __call__(self):
        return self.first()

    def time(self, dev: torch.device, iters: int) -> tuple[tuple[float, float], list[float]]:
        self.second()  # (built and warm before the first round)
        medians: tuple[list[float], list[float]] = ([], [])
        for i in range(self.rounds):  # first, second; second, first; ...: a drift within a round cancels in pairs
            pairs = list(zip((self.first, self.second), medians))
            for fn, out in pairs if i % 2 == 0 else pairs[::-1]:
                out.append(time_fn(fn, dev, warmup=1, iters=iters, max_seconds=2.0).median_ms)
        ratios = [a / b for a, b in zip(*medians)]
        return (statistics.median(medians[0]), statistics.median(medians[1])), ratios


def host_ms(fn, calls: int = 20) -> float:
    """CPU time to enqueue one call (the GPU may still be busy): above the GPU time, the host bounds the call."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e3


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def markdown(result: dict) -> str:
    """The sweep as a Markdown table, with the environment and command that produced it."""
    env = result["environment"]
    lines = [f"GPU {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, "
             f"SageAttention {env.get('sageattention', 'not recorded')}, input locality {env.get('locality', 0.5)}, "
             f"K mean {env.get('k_mean', 0.0)}, V mean {env.get('v_mean', 0.0)}, reach spread {env.get('reach_spread', 0.0)}; "
             f"`{result['command']}`", "",
             *([f"Builds (`-D` defines of csrc/sage_sm90.cu): "
                + "; ".join(f"`{b}`: {' '.join(d) or '(none)'}" for b, d in env["builds"].items()), ""]
               if env.get("builds") else []),
             "`host ms`: CPU time to enqueue one call (measured on calls under 5 ms); a call cannot run faster.", "",
             "`skipped`: the fraction of 64 x 128 tiles the kernel skipped, by its own counter. A row timed "
             "`alternating` gives the first call's time (before the `|` in its name), and the second's in `ms` after "
             "the `|`: each the median of its rounds, taken in turn (the paired ratios per round: the table "
             "below).", "",
             "| shape | implementation | ms | vs cuDNN | skipped | rel-L1 | cosine | host ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]

    def cell(value, fmt):
        return "" if value is None else format(value, fmt)

    def name(r):  # (an alternating row's "|" would end the cell)
        return r["impl"].replace("|", "\\|")

    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {name(r)} | failed: {r['error']} | | | | | |")
        else:
            ms = f"{r['ms']:.3f}" + (f" \\| {r['ms_second']:.3f}" if "ms_second" in r else "")
            lines.append(f"| {r['shape']} | {name(r)} | {ms} | {r['vs_cudnn']:.3f}x | {cell(r.get('skipped'), '.3f')} | "
                         f"{cell(r.get('rel_l1'), '.4f')} | {cell(r.get('cosine'), '.5f')} | "
                         f"{cell(r.get('host_ms'), '.3f')} |")
    paired = [r for r in result["rows"] if "round_ratios" in r]
    if paired:
        lines += ["", "Alternating rows, first / second time per round (above 1: the second is faster):", "",
                  "| shape | pair | median | middle half | min - max | rounds |", "|---|---|---:|---:|---:|---:|"]
        for r in paired:
            q1, q3 = r["round_ratio_quartiles"]
            lines.append(f"| {r['shape']} | {name(r)} | {r['round_ratio_median']:.4f} | {q1:.4f} - {q3:.4f} | "
                         f"{min(r['round_ratios']):.4f} - {max(r['round_ratios']):.4f} | {len(r['round_ratios'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="wan_14b_480p,wan_14b_720p,flux_1024")
    p.add_argument("--builds", default=",".join(BUILDS))
    p.add_argument("--quants", default="k16", help=f"SAGE settings of the kernel's rows: {', '.join(QUANTS)}")
    p.add_argument("--target-skips", default="0.5")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--locality", type=float, default=0.5,
                   help="inputs' local structure (0: diffuse attention over every key, where error that grows with "
                        "the number of tiles shows most)")
    p.add_argument("--k-mean", type=float, default=0.0,
                   help="a per-channel mean added to K, in K's standard deviations (0: zero-mean K; a trained "
                        "model's keys have one of a few, which int8 K blocks are sensitive to unless smoothed)")
    p.add_argument("--v-mean", type=float, default=0.0,
                   help="a per-channel mean added to V, in V's standard deviations (0: zero-mean V; a model's "
                        "values have one, which the fp8 accumulator of P.V is sensitive to)")
    p.add_argument("--out", default=None, help="JSON results file; a Markdown table is written beside it")
    p.add_argument("--build-only", action="store_true",
                   help="compile the builds' cubins into the cache ($DIFFUSERS_TRTLLM_CACHE) and stop: no GPU needed, "
                        "so a GPU session can carry them instead of compiling")
    p.add_argument("--jobs", type=int, default=os.cpu_count(), help="builds at once with --build-only")
    p.add_argument("--nvcc", default=None, help="also time the default build compiled by this nvcc")
    p.add_argument("--reach-spread", type=float, default=0.0,
                   help="heads' reach differing by this many octaves either way (trained video models' heads do)")
    p.add_argument("--no-triton-skip", action="store_true", help="leave out the triton route's skip rows (a skip curve's "
                   "many thresholds)")
    p.add_argument("--alternate-skip", action="store_true",
                   help="also time the default build's skip off against skip on at nothing skipped and at each target, "
                        "in alternating rounds (for the ratios, free of drift between rows)")
    p.add_argument("--alternate-builds", action="store_true",
                   help="also time each build other than the default against the default in alternating rounds, with skip "
                        "off, at nothing skipped and at each target (list default first)")
    p.add_argument("--kernel-only-builds", action="store_true",
                   help="also time every build's kernel alone on the quantizer's output (the default's 'kernel only' "
                        "row), and with --alternate-builds each against the default's kernel in alternating rounds")
    p.add_argument("--rounds", type=int, default=8, help="rounds of each alternating pair")
    p.add_argument("--replot", metavar="JSON", help="only redraw the skip curve of a results file (no GPU needed)")
    args = p.parse_args()
    if args.replot:
        print(plot_skip_curve(args.replot))
        return
    unknown = [b for b in args.builds.split(",") if b and b not in BUILDS]
    if unknown:
        p.error(f"unknown builds {unknown}; known: {', '.join(BUILDS)}")
    builds = {b: BUILDS[b] for b in args.builds.split(",") if b}
    unknown = [x for x in args.quants.split(",") if x and x not in QUANTS]
    if unknown:
        p.error(f"unknown quants {unknown}; known: {', '.join(QUANTS)}")
    quants = {x: QUANTS[x] for x in args.quants.split(",") if x}
    if args.rounds < 2:
        p.error(f"--rounds must be at least 2 (a ratio's spread needs two); got {args.rounds}")
    if args.alternate_builds and "default" not in builds:
        p.error("--alternate-builds times the other builds against the default: add default to --builds")
    if args.build_only:
        dims = {shape.head_dim for shape in parse_shapes(args.shapes)}
        blocks = {qc.k_block_size for qc in quants.values()}
        variants = [v for v in VARIANTS if v.head_dim in dims and v.k_block_size in blocks and v.out_dtype == torch.bfloat16]
        for cubin in build_kernels(variants, builds.values(), args.jobs):
            print(cubin)
        return
    targets = [float(x) for x in args.target_skips.split(",") if x]
    rows = []
    env = environment(locality=args.locality, k_mean=args.k_mean, v_mean=args.v_mean, reach_spread=args.reach_spread,
                      builds={b: list(d) for b, d in builds.items()})

    def save(shape_rows: list[dict]) -> None:  # after every row: a call cut short by its time limit keeps its rows
        if args.out:
            write_result(args.out, "bench_sage_sm90.py", env, rows + shape_rows, markdown)

    for shape in parse_shapes(args.shapes):
        rows += run_shape(shape, builds, quants, targets, args.iters, args.locality, args.k_mean, args.v_mean,
                          args.nvcc, args.reach_spread, not args.no_triton_skip, args.alternate_skip,
                          args.alternate_builds, args.rounds, on_row=save, kernel_only_builds=args.kernel_only_builds)
        torch.cuda.empty_cache()
    if args.out:
        plot_skip_curve(args.out)


def plot_skip_curve(result_json: str) -> str | None:
    """The kernel's speed over cuDNN against the fraction of tiles it skipped, per shape and build, beside
    the same build with skip off, SageAttention2 and the ideal (a skipped tile costing nothing): a PNG beside
    the JSON. None (nothing written) without skip rows or matplotlib."""
    with open(result_json) as f:
        result = json.load(f)
    rows = [r for r in result["rows"] if "error" not in r]
    curves: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in rows:
        # (+skip0 runs the kernel without skip; +skiptiny is the curve's point at nothing skipped)
        if "skipped" in r and not r["impl"].endswith(("+skipall", "+skip0")):
            curves.setdefault((r["shape"], r["impl"].partition("+skip")[0]), []).append((r["skipped"], r["vs_cudnn"]))
    if not curves:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    speed = {(r["shape"], r["impl"]): r["vs_cudnn"] for r in rows}
    shapes = sorted({shape for shape, _ in curves})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for (s, impl), pts in sorted(curves.items()):
            if s != shape:
                continue
            pts.sort()
            line, = ax.plot(*zip(*pts), "o-", markersize=4, label=f"{impl} + skip")
            if (off := speed.get((shape, impl))) is not None:
                ax.axhline(off, color=line.get_color(), ls=":", lw=1, label=f"{impl}, skip off")
                xs = [i / 100 for i in range(0, 61)]
                ax.plot(xs, [off / (1 - x) for x in xs], color=line.get_color(), ls="--", lw=0.8,
                        label=f"{impl}: ideal (skipped tiles free)")
        if (sa := speed.get((shape, "sageattn"))) is not None:
            ax.axhline(sa, color="k", ls="-.", lw=1, label="SageAttention2")
        ax.set_title(f"{shape}, reach spread {result['environment'].get('reach_spread', 0.0)}")
        ax.set_xlabel("tiles skipped (the kernel's counter)")
        ax.set_ylabel("speed over cuDNN SDPA (same run)")
        ax.set_xlim(0, 0.6)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    path = os.path.splitext(result_json)[0] + ".png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def environment(**extra) -> dict:
    """GPU and versions, for a results file."""
    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
                cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), triton=triton.__version__,
                sageattention=_version("sageattention"), **extra)


def write_result(out: str, script: str, env: dict, rows: list[dict], to_markdown) -> None:
    """``out`` (JSON: environment, command, rows) and its Markdown table beside it."""
    result = dict(environment=env, command=" ".join(["python3", f"benchmarks/{script}", *sys.argv[1:]]), rows=rows)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(to_markdown(result))

if __name__ == "__main__":
    main()
