"""What a CTA of the ``sage-sm90`` kernel costs besides its KV tiles: the kernel alone, GPU-bound, at a fixed
number of query tokens (so a fixed grid) and a growing number of keys (CUDA GPU, sm_90).

    python3 benchmarks/cta_cost.py --queries 4608,16896 --keys 128,512,1152,2304,4608 [--defines D=1,...] --out X.json

At a fixed grid the kernel's time is a line in the KV tiles each CTA runs: ``rounds * (tiles * per_tile +
per_cta)``, ``rounds`` the waves of CTAs the GPU runs one after another (one CTA an SM by default). The fit's
intercept over the rounds is what a CTA pays once (its prologue, the pipeline's fill and drain, the epilogue),
which at Flux 1024²'s 36 KV tiles a CTA weighs more than at 32k tokens' 256 (issue 57). Each time is the median
of ``--iters`` launches queued behind a GPU sleep, so no launch waits for the host. cuDNN SDPA on the same
inputs is timed the same way beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from bench_sage_sm90 import environment

from diffusers_trtllm.bench.inputs import Shape, structured_qkv
from diffusers_trtllm.config import QuantConfig
from diffusers_trtllm.kernels.sage_sm90 import BLOCK_N, _cta, sage_sm90_attention, sage_sm90_quantize
from diffusers_trtllm.kernels.triton_launch import cdiv
from diffusers_trtllm.layout import PackedLayout


def gpu_ms(fn, iters: int) -> float:
    """Median GPU milliseconds of ``fn`` over ``iters`` launches queued behind a sleep (each timed by events)."""
    fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda._sleep(int(2e8))
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in events)[iters // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queries", default="4608,16896", help="query tokens (one sequence), comma-separated")
    p.add_argument("--keys", default="128,512,1152,2304,4608", help="key tokens, comma-separated")
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--defines", default="", help="the kernel build's -D knobs, comma-separated (SAGE_SM90_STAGES=3)")
    p.add_argument("--out", type=Path, default=None, help="JSON results; a Markdown table is written beside it")
    args = p.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    quant = QuantConfig("int8")
    defines = tuple(d for d in args.defines.split(",") if d)
    cta = _cta(defines)
    scale = args.head_dim ** -0.5
    if cta.persistent:
        raise SystemExit("cta_cost.py fits one CTA a work tile; SAGE_SM90_PERSISTENT builds loop over tiles instead")
    rows, fits = [], []
    for nq in map(int, args.queries.split(",")):
        points = []
        for nk in map(int, args.keys.split(",")):
            shape = Shape(f"{nq}x{nk}", 1, nq, args.heads, args.head_dim, kv_tokens=nk)
            q, k, v = structured_qkv(shape, 0.5, device=dev, k_mean=4.0)
            packed = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
            layout = PackedLayout.dense(1, nq, nk, dev)
            quantized = sage_sm90_quantize(*packed, layout, quant)
            ours = gpu_ms(lambda: sage_sm90_attention(*packed, layout, softmax_scale=scale, quant=quant,
                                                      quantized=quantized, defines=defines), args.iters)
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                cudnn = gpu_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt), args.iters)
            ctas = cdiv(nq, cta.rows) * args.heads
            tiles = cdiv(nk, BLOCK_N)
            row = dict(queries=nq, keys=nk, ctas=ctas, rounds=cdiv(ctas, sms * cta.per_sm), kv_tiles=tiles, kernel_ms=ours,
                       cudnn_ms=cudnn, vs_cudnn=cudnn / ours)
            rows.append(row)
            points.append((tiles, ours))
            print(json.dumps(row), flush=True)
        if len(points) < 2:  # one length (an ncu run): no line to fit
            continue
        c1, c0 = np.polyfit(*zip(*points), 1)  # ms = c0 + c1 * tiles
        rounds = rows[-1]["rounds"]
        fits.append(dict(queries=nq, rounds=rounds, intercept_ms=c0, per_tile_round_us=c1 * 1e3 / rounds,
                         per_cta_us=c0 * 1e3 / rounds))
        print(json.dumps(fits[-1]), flush=True)
    if args.out:
        env = environment(sms=sms, defines=list(defines))
        command = " ".join(["python3", "benchmarks/cta_cost.py", *sys.argv[1:]])
        args.out.write_text(json.dumps(dict(environment=env, command=command, rows=rows, fits=fits), indent=1))
        head = (f"GPU {env['gpu']} ({sms} SMs), torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, "
                f"Triton {env['triton']}{', build ' + ','.join(defines) if defines else ''}; `{command}`")
        lines = [head, "", "| queries | keys | CTAs | rounds | KV tiles a CTA | kernel ms | cuDNN ms | vs cuDNN |",
                 "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['queries']} | {r['keys']} | {r['ctas']} | {r['rounds']} | {r['kv_tiles']} | "
                  f"{r['kernel_ms']:.4f} | {r['cudnn_ms']:.4f} | {r['vs_cudnn']:.3f}x |" for r in rows]
        lines += ["", "| queries | rounds | intercept ms | per KV tile a round, us | per CTA, us |",
                  "|---:|---:|---:|---:|---:|"]
        lines += [f"| {f['queries']} | {f['rounds']} | {f['intercept_ms']:.4f} | {f['per_tile_round_us']:.3f} | "
                  f"{f['per_cta_us']:.2f} |" for f in fits]
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
