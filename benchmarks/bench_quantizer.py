"""Time the SAGE quantizer (``triton_quant``, the ``sage-sm90`` layout) over its launch settings (CUDA GPU).

    python3 benchmarks/bench_quantizer.py --shapes wan_14b_480p,flux_1024 --out benchmarks/results/quantizer_h200.json

Each setting is (tokens per Q/V program, warps), per ``--k-blocks`` value (K programs take tiles of
max(tokens, K block)); every setting's output must equal the default's bit for bit (the layout does not depend
on them). ``--baseline FILE`` times another version of ``triton_quant.py`` beside them (an earlier commit's,
``git show REV:diffusers_trtllm/kernels/triton_quant.py > FILE``), its output checked the same way.
``copy ms`` is torch copying Q, K and V once (reads and writes of the quantizer's input size): the memory
floor. ``stats ms`` is the torch reductions the quantizer runs before its launch (K's and V's means, V's
per-channel min and max), included in ``ms``.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
from types import ModuleType

import torch
from tqdm import tqdm

from bench_sage_sm90 import environment, write_result
from diffusers_trtllm.bench.inputs import parse_shapes, structured_qkv
from diffusers_trtllm.bench.timing import time_fn
from diffusers_trtllm.config import QuantConfig
from diffusers_trtllm.kernels import triton_quant
from diffusers_trtllm.kernels.reference import channel_mean
from diffusers_trtllm.kernels.sage_sm90 import sage_sm90_quantize
from diffusers_trtllm.layout import PackedLayout

SETTINGS = ("QUANT_BLOCK_T", "QUANT_WARPS")


def load_baseline(path: str) -> ModuleType:
    """A ``triton_quant.py`` from elsewhere, imported as a sibling of ours (its relative imports resolve)."""
    spec = importlib.util.spec_from_file_location("diffusers_trtllm.kernels.baseline_quant", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _outputs(st) -> list[torch.Tensor]:
    return [st.q, st.k, st.vt, st.q_scale, st.k_scale, st.v_scale]


def _same(out: list[torch.Tensor], ref: list[torch.Tensor]) -> bool:
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)
               for a, b in zip(out, ref))


def run_shape(shape, grid: list[tuple[int, ...]], iters: int, k_block: int, baseline: ModuleType | None) -> list[dict]:
    dev = torch.device("cuda")
    q, k, v = (x[0].contiguous() for x in structured_qkv(shape, 0.5, device=dev))
    layout = PackedLayout.dense(1, q.shape[0], k.shape[0], dev)
    quant = QuantConfig("int8", 1, k_block)
    default = tuple(getattr(triton_quant, name) for name in SETTINGS)
    ref = _outputs(sage_sm90_quantize(q, k, v, layout, quant))
    time = lambda fn: time_fn(fn, dev, warmup=3, iters=iters).median_ms  # noqa: E731
    base = dict(shape=shape.name, k_block=k_block, copy_ms=time(lambda: [x.clone() for x in (q, k, v)]),
                stats_ms=time(lambda: (channel_mean(k), channel_mean(v), torch.aminmax(v, dim=0))))
    candidates = [(dict(zip(SETTINGS, setting), default=setting == default), setting) for setting in grid]
    if baseline is not None:
        candidates.append((dict(zip(SETTINGS, ("baseline",) * len(SETTINGS)), default=False), None))
    rows = []
    for labels, setting in tqdm(candidates, desc=shape.name, unit="setting"):
        if setting is None:
            quantize = lambda: baseline.sage_quantize_triton(q, k, v, layout, quant, mma_key_order=True)  # noqa: E731
        else:
            quantize = lambda: sage_sm90_quantize(q, k, v, layout, quant)  # noqa: E731
            for name, value in zip(SETTINGS, setting):
                setattr(triton_quant, name, value)
        try:
            same = _same(_outputs(quantize()), ref)
            rows.append(dict(base, **labels, ms=time(quantize), same_as_default=same))
            print(f"{shape.name:14s} k{k_block} {labels} {rows[-1]['ms']:7.3f} ms (copy {base['copy_ms']:.3f}, "
                  f"stats {base['stats_ms']:.3f}) same={same}", flush=True)
        except Exception as err:  # report and go on
            rows.append(dict(base, **labels, error=f"{type(err).__name__}: {err}"))
            print(f"{shape.name:14s} {labels} FAILED {type(err).__name__}: {err}", flush=True)
        finally:
            for name, value in zip(SETTINGS, default):
                setattr(triton_quant, name, value)
    return rows


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"GPU {env['gpu']}, torch {env['torch']}, Triton {env['triton']}; `{result['command']}`", "",
             "| shape | k_block_size | " + " | ".join(SETTINGS) + " | ms | copy ms | stats ms | same as default |",
             "|---|---:|" + "---:|" * len(SETTINGS) + "---:|---:|---:|---|"]
    for r in result["rows"]:
        cells = " | ".join(str(r[name]) for name in ("k_block", *SETTINGS))
        if "error" in r:
            lines.append(f"| {r['shape']} | {cells} | failed: {r['error']} | | | |")
        else:
            mark = " (default)" if r["default"] else ""
            lines.append(f"| {r['shape']} | {cells} | {r['ms']:.3f}{mark} | {r['copy_ms']:.3f} | {r['stats_ms']:.3f} "
                         f"| {r['same_as_default']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="wan_14b_480p,wan_14b_720p,flux_1024")
    p.add_argument("--block-t", default="64,128", help="tokens per Q/V program (multiples of 16)")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--k-blocks", default="16,128", help="SAGE k_block_size values (128: K tiles of 128 tokens)")
    p.add_argument("--baseline", default=None, help="another triton_quant.py to time beside these settings")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None, help="JSON results file; a Markdown table is written beside it")
    args = p.parse_args()
    axes = [[int(x) for x in a.split(",")] for a in (args.block_t, args.warps)]
    grid = list(itertools.product(*axes))
    baseline = load_baseline(args.baseline) if args.baseline else None
    rows = [row for shape in parse_shapes(args.shapes) for kb in map(int, args.k_blocks.split(","))
            for row in run_shape(shape, grid, args.iters, kb, baseline)]
    if args.out:
        write_result(args.out, "bench_quantizer.py", environment(), rows, markdown)


if __name__ == "__main__":
    main()
