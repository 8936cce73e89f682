"""Time the SAGE quantizer (``triton_quant``, the ``sage-sm90`` layout) over its launch settings (CUDA GPU).

    python3 benchmarks/bench_quantizer.py --shapes wan_14b_480p,flux_1024 --out benchmarks/results/quantizer_h200.json

Each setting is (tokens per Q/V program, warps per program of that many tokens, the launches of K's and V's
tiles), per ``--k-blocks`` value (K programs take tiles of max(tokens, K block)); every setting's output must
equal the default's bit for bit (the layout does not depend on them). ``--baseline FILE[,FILE]`` times other
versions of ``triton_quant.py`` beside them (an earlier commit's,
``git show REV:diffusers_trtllm/kernels/triton_quant.py > FILE``), their output checked the same way. Every time
is GPU-bound (``cta_cost.gpu_ms``: launches queued behind a GPU sleep), so the host's share, the same for every
setting, does not hide the GPU's. ``copy ms``
is torch copying Q, K and V once (reads and writes of the quantizer's input size): the memory floor. ``ms`` is the
whole quantizer, K and V's statistics (V's mean, min and max, K's sampled mean) included: they run in its first
launch beside Q's tiles. A second table times, per statistics setting (tokens per span, per step, and the steps its
loads are issued ahead), those programs alone (``kv_stats``), the whole quantizer with them, and the same
statistics by torch's reductions (one pass for V's mean, one for its min and max). ``differ`` counts the output
values (and scales) not bit-equal to the default setting's: 0 for every setting; a baseline whose V mean is summed
in another order may move a few fp8 values of V by a rounding step.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import os
import sys
from types import ModuleType

import torch
from tqdm import tqdm

from bench_sage_sm90 import environment, write_result
from cta_cost import gpu_ms
from diffusers_trtllm.bench.inputs import parse_shapes, structured_qkv
from diffusers_trtllm.config import QuantConfig
from diffusers_trtllm.kernels import triton_quant
from diffusers_trtllm.kernels.reference import channel_mean, key_mean
from diffusers_trtllm.kernels.sage_sm90 import K_BLOCK, K_PER_THREAD, sage_sm90_quantize
from diffusers_trtllm.layout import PackedLayout

SETTINGS = ("QUANT_BLOCK_T", "QUANT_WARPS", "QUANT_LAUNCHES")
STATS_SETTINGS = ("V_STATS_ROWS", "V_STATS_BLOCK_T", "V_STATS_STAGES")


def load_baseline(path: str, index: int) -> ModuleType:
    """A ``triton_quant.py`` from elsewhere, imported as a sibling of ours (its relative imports resolve)."""
    spec = importlib.util.spec_from_file_location(f"diffusers_trtllm.kernels.baseline_quant{index}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _outputs(st) -> list[torch.Tensor]:
    return [st.q, st.k, st.vt, st.q_scale, st.k_scale, st.v_scale]


def _differ(out: list[torch.Tensor], ref: list[torch.Tensor]) -> int:
    return sum(int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) if a.element_size() == 1 else int((a != b).sum())
               for a, b in zip(out, ref))


def run_shape(shape, grid: list[tuple], stats_grid: list[tuple[int, ...]], iters: int, k_block: int,
              baselines: dict[str, ModuleType]) -> list[dict]:
    dev = torch.device("cuda")
    q, k, v = (x[0].contiguous() for x in structured_qkv(shape, 0.5, device=dev))
    layout = PackedLayout.dense(1, q.shape[0], k.shape[0], dev)
    quant = QuantConfig("int8", 1, k_block)
    ref = _outputs(sage_sm90_quantize(q, k, v, layout, quant))
    time = lambda fn: gpu_ms(fn, iters)  # noqa: E731
    base = dict(shape=shape.name, k_block=k_block, copy_ms=time(lambda: [x.clone() for x in (q, k, v)]),
                torch_stats_ms=time(lambda: (key_mean(k), channel_mean(v), torch.aminmax(v, dim=0))))
    quantize = functools.partial(sage_sm90_quantize, q, k, v, layout, quant)
    rows = [dict(base, table="stats", **dict(zip(STATS_SETTINGS, setting)), default=setting == _current(STATS_SETTINGS),
                 ms=_with(STATS_SETTINGS, setting, lambda: time(lambda: triton_quant.kv_stats(k, v, True))),
                 quantize_ms=_with(STATS_SETTINGS, setting, lambda: time(quantize)))
            for setting in stats_grid]
    candidates = [(dict(zip(SETTINGS, setting), default=setting == _current(SETTINGS)), setting, None) for setting in grid]
    candidates += [(dict(zip(SETTINGS, (name,) * len(SETTINGS)), default=False), None, module)
                   for name, module in baselines.items()]
    for labels, setting, module in tqdm(candidates, desc=shape.name, unit="setting"):
        if module is not None:
            quantize = functools.partial(module.sage_quantize_triton, q, k, v, layout,  # as sage_sm90_quantize calls it
                                         quant.with_k_block(K_BLOCK, K_PER_THREAD), mma_key_order=True)
        else:
            quantize = functools.partial(_with, SETTINGS, setting, lambda: sage_sm90_quantize(q, k, v, layout, quant))
        try:
            differ = _differ(_outputs(quantize()), ref)
            rows.append(dict(base, table="quantize", **labels, ms=time(quantize), differ=differ))
            print(f"{shape.name:14s} k{k_block} {labels} {rows[-1]['ms']:7.3f} ms (copy {base['copy_ms']:.3f}) "
                  f"differ={differ}", flush=True)
        except Exception as err:  # report and go on
            rows.append(dict(base, table="quantize", **labels, error=f"{type(err).__name__}: {err}"))
            print(f"{shape.name:14s} {labels} FAILED {type(err).__name__}: {err}", flush=True)
    return rows


def _current(names: tuple[str, ...]) -> tuple:
    return tuple(getattr(triton_quant, name) for name in names)


def _with(names: tuple[str, ...], setting: tuple, fn):
    """``fn()`` with ``triton_quant``'s module settings ``names`` set to ``setting``, restored after."""
    saved = _current(names)
    for name, value in zip(names, setting):
        setattr(triton_quant, name, value)
    try:
        return fn()
    finally:
        for name, value in zip(names, saved):
            setattr(triton_quant, name, value)


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"GPU {env['gpu']}, torch {env['torch']}, Triton {env['triton']}; `{result['command']}`", ""]
    for table, names, extra in (("quantize", SETTINGS, ("copy ms", "differ")),
                                ("stats", STATS_SETTINGS, ("quantize ms", "torch stats ms"))):
        lines += ["| shape | k_block_size | " + " | ".join(names + ("ms",) + extra) + " |",
                  "|---|---:|" + "---:|" * (len(names) + 1 + len(extra))]
        for r in (r for r in result["rows"] if r["table"] == table):
            cells = " | ".join(str(r[name]) for name in ("k_block", *names))
            if "error" in r:
                lines.append(f"| {r['shape']} | {cells} | failed: {r['error']} |" + " |" * len(extra))
                continue
            mark = " (default)" if r["default"] else ""
            tail = (f"{r['copy_ms']:.3f} | {r['differ']}" if table == "quantize"
                    else f"{r['quantize_ms']:.3f} | {r['torch_stats_ms']:.3f}")
            lines.append(f"| {r['shape']} | {cells} | {r['ms']:.3f}{mark} | {tail} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="wan_14b_480p,wan_14b_720p,flux_1024")
    p.add_argument("--block-t", default="64,128", help="tokens per Q/V program (multiples of 16)")
    p.add_argument("--warps", default="4,8", help="warps per program of --block-t tokens")
    p.add_argument("--launches", default="kv;k,v",
                   help="';'-separated plans for the launches after the first, each the parts (K, V) of each launch "
                        "(of calls past QUANT_ONE_LAUNCH_TOKENS keys: shorter ones make QUANT_SHORT_LAUNCHES)")
    p.add_argument("--stats", default="512x16x3,512x16x1,256x16x3,512x32x3",
                   help="statistics settings, tokens per span x per step x steps loaded ahead")
    p.add_argument("--k-blocks", default="16,128", help="SAGE k_block_size values (128: K tiles of 128 tokens)")
    p.add_argument("--baseline", default="", help="other triton_quant.py files (comma-separated) to time beside these")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None, help="JSON results file; a Markdown table is written beside it")
    args = p.parse_args()
    axes = [[int(x) for x in a.split(",")] for a in (args.block_t, args.warps)]
    launches = [tuple(plan.split(",")) for plan in args.launches.split(";")]
    grid = list(itertools.product(*axes, launches))
    stats_grid = [tuple(map(int, s.split("x"))) for s in args.stats.split(",")]
    baselines = {os.path.basename(path): load_baseline(path, i) for i, path in enumerate(filter(None, args.baseline.split(",")))}
    rows = [row for shape in parse_shapes(args.shapes) for kb in map(int, args.k_blocks.split(","))
            for row in run_shape(shape, grid, stats_grid, args.iters, kb, baselines)]
    if args.out:
        write_result(args.out, "bench_quantizer.py", environment(), rows, markdown)


if __name__ == "__main__":
    main()
