"""How fast the SAGE quantizer (``triton_quant``, the ``sage-sm90`` layout) moves its bytes (CUDA GPU).

    python3 benchmarks/quantizer_floor.py --shapes flux_1024,flux_2048=1:16896:24:128 [--variants A.py,B.py] --out X.json

GPU-bound (launches queued behind a sleep, ``cta_cost.gpu_ms``), per shape: the whole quantizer and its statistics
alone (``kv_stats``); the pace of the bytes it must move (``TB/s``: Q, K and V read, V read again for its statistics,
which need every token before any V is quantized, one byte written per value); and torch casting Q, K and V to a
one-byte type plus one more read of V: the same bytes with no arithmetic, which nonetheless ran slower than the
quantizer (four launches), so it is a reference, not a floor. Each ``--variants`` file is another
``triton_quant.py`` (``bench_quantizer.load_baseline``), timed beside ours and its outputs compared with ours value
for value (``differ``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from bench_quantizer import _differ, _outputs, load_baseline
from bench_sage_sm90 import environment
from cta_cost import gpu_ms

from diffusers_trtllm.bench.inputs import parse_shapes, structured_qkv
from diffusers_trtllm.config import QuantConfig
from diffusers_trtllm.kernels import triton_quant
from diffusers_trtllm.kernels.sage_sm90 import K_BLOCK, K_PER_THREAD
from diffusers_trtllm.layout import PackedLayout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="flux_1024,flux_2048=1:16896:24:128")
    p.add_argument("--variants", default="", help="other triton_quant.py files, comma-separated")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", type=Path, default=None, help="JSON results; a Markdown table is written beside it")
    args = p.parse_args()
    dev = torch.device("cuda")
    quant = QuantConfig("int8", smooth_k=True).with_k_block(K_BLOCK, K_PER_THREAD)
    variants = filter(None, args.variants.split(","))
    modules = {"ours": triton_quant} | {path: load_baseline(path, i) for i, path in enumerate(variants)}
    rows = []
    for shape in parse_shapes(args.shapes):
        q, k, v = (x.reshape(-1, *x.shape[2:]) for x in structured_qkv(shape, 0.5, device=dev, k_mean=4.0))
        layout = PackedLayout.dense(1, q.shape[0], k.shape[0], dev)
        int8 = [torch.empty(x.shape, dtype=torch.int8, device=dev) for x in (q, k)]
        fp8 = torch.empty(v.shape, dtype=torch.float8_e4m3fn, device=dev)
        casts = gpu_ms(lambda: (int8[0].copy_(q), int8[1].copy_(k), fp8.copy_(v), v.amax()), args.iters)
        moved = sum(x.numel() * 3 for x in (q, k, v)) + v.numel() * 2
        ref = None
        for name, module in modules.items():
            fn = lambda m=module: m.sage_quantize_triton(q, k, v, layout, quant, mma_key_order=True)  # noqa: E731
            out = _outputs(fn())
            ref = ref or out
            ms = gpu_ms(fn, args.iters)
            row = dict(shape=shape.name, quantizer=name, quantizer_ms=ms, tb_s=moved / ms / 1e9,
                       stats_ms=gpu_ms(lambda m=module: m.kv_stats(k, v, True), args.iters), casts_ms=casts,
                       differ=_differ(out, ref))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        command = " ".join(["python3", "benchmarks/quantizer_floor.py", *sys.argv[1:]])
        result = dict(environment=environment(), command=command, rows=rows)
        args.out.write_text(json.dumps(result, indent=1))
        args.out.with_suffix(".md").write_text(markdown(result))


def markdown(result: dict) -> str:
    env = result["environment"]
    head = f"GPU {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, Triton {env['triton']}; `{result['command']}`"
    lines = [head, "", "| shape | quantizer | ms | TB/s | stats alone ms | torch casts ms | differ |",
             "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['shape']} | {r['quantizer']} | {r['quantizer_ms']:.4f} | {r['tb_s']:.2f} | {r['stats_ms']:.4f} | "
              f"{r['casts_ms']:.4f} | {r['differ']} |" for r in result["rows"]]
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    main()
