"""Time the SAGE quantizer (``triton_quant``, the ``sage-sm90`` layout) over its launch settings (CUDA GPU).

    python3 benchmarks/bench_quantizer.py --shapes wan_14b_480p,flux_1024 --out benchmarks/results/quantizer_h200.json

Each setting is (V channels per program, tokens V reads at a time, tokens per Q/K program, warps), per
``--k-blocks`` value (K blocks of 128 take Q/K tiles of 128 tokens whatever the setting); every setting's
output must equal the default's bit for bit (the layout does not depend on them). ``copy ms`` is
torch copying Q, K and V once (reads and writes of the quantizer's input size): the memory floor.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from tqdm import tqdm

from bench_sage_sm90 import environment, write_result
from diffusers_trtllm.bench.inputs import parse_shapes, structured_qkv
from diffusers_trtllm.bench.timing import time_fn
from diffusers_trtllm.config import QuantConfig
from diffusers_trtllm.kernels import triton_quant
from diffusers_trtllm.kernels.sage_sm90 import sage_sm90_quantize
from diffusers_trtllm.layout import PackedLayout

SETTINGS = ("V_CHANNELS", "V_BLOCK_T", "QUANT_BLOCK_T", "QUANT_WARPS")


def _outputs(st) -> list[torch.Tensor]:
    return [st.q, st.k, st.vt, st.q_scale, st.k_scale, st.v_scale]


def run_shape(shape, grid: list[tuple[int, ...]], iters: int, k_block: int) -> list[dict]:
    dev = torch.device("cuda")
    q, k, v = (x[0].contiguous() for x in structured_qkv(shape, 0.5, device=dev))
    layout = PackedLayout.dense(1, q.shape[0], k.shape[0], dev)
    quant = QuantConfig("int8", 1, k_block)
    default = tuple(getattr(triton_quant, name) for name in SETTINGS)
    ref = _outputs(sage_sm90_quantize(q, k, v, layout, quant))
    copy = time_fn(lambda: [x.clone() for x in (q, k, v)], dev, warmup=3, iters=iters).median_ms
    rows = []
    for setting in tqdm(grid, desc=shape.name, unit="setting"):
        for name, value in zip(SETTINGS, setting):
            setattr(triton_quant, name, value)
        try:
            out = _outputs(sage_sm90_quantize(q, k, v, layout, quant))
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1
                       else torch.equal(a, b) for a, b in zip(out, ref))
            ms = time_fn(lambda: sage_sm90_quantize(q, k, v, layout, quant), dev, warmup=3, iters=iters).median_ms
            rows.append(dict(shape=shape.name, k_block=k_block, **dict(zip(SETTINGS, setting)), ms=ms, copy_ms=copy,
                             default=setting == default, same_as_default=same))
            print(f"{shape.name:14s} k{k_block} {setting} {ms:7.3f} ms (copy {copy:.3f}) same={same}", flush=True)
        except Exception as err:  # report and go on
            rows.append(dict(shape=shape.name, k_block=k_block, **dict(zip(SETTINGS, setting)), error=f"{type(err).__name__}: {err}"))
            print(f"{shape.name:14s} {setting} FAILED {type(err).__name__}: {err}", flush=True)
        finally:
            for name, value in zip(SETTINGS, default):
                setattr(triton_quant, name, value)
    return rows


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"GPU {env['gpu']}, torch {env['torch']}, Triton {env['triton']}; `{result['command']}`", "",
             "| shape | k_block_size | " + " | ".join(SETTINGS) + " | ms | copy ms | same as default |",
             "|---|---:|" + "---:|" * len(SETTINGS) + "---:|---:|---|"]
    for r in result["rows"]:
        cells = " | ".join(str(r[name]) for name in ("k_block", *SETTINGS))
        if "error" in r:
            lines.append(f"| {r['shape']} | {cells} | failed: {r['error']} | | |")
        else:
            mark = " (default)" if r["default"] else ""
            lines.append(f"| {r['shape']} | {cells} | {r['ms']:.3f}{mark} | {r['copy_ms']:.3f} | {r['same_as_default']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="wan_14b_480p,wan_14b_720p,flux_1024")
    p.add_argument("--v-channels", default="8,16")
    p.add_argument("--v-block", default="128,512")
    p.add_argument("--block-t", default="64,128")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--k-blocks", default="16", help="SAGE k_block_size values (128: Q/K tiles of 128 tokens)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None, help="JSON results file; a Markdown table is written beside it")
    args = p.parse_args()
    axes = [[int(x) for x in a.split(",")] for a in (args.v_channels, args.v_block, args.block_t, args.warps)]
    grid = list(itertools.product(*axes))
    rows = [row for shape in parse_shapes(args.shapes) for kb in map(int, args.k_blocks.split(","))
            for row in run_shape(shape, grid, args.iters, kb)]
    if args.out:
        write_result(args.out, "bench_quantizer.py", environment(), rows, markdown)

if __name__ == "__main__":
    main()
