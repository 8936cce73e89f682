"""What a user sees on first use (H100/H200): the cold first int8 call, and what ``auto`` runs without a toolkit.

    python3 benchmarks/bench_first_use.py --out benchmarks/results/first_use_h200.json
    CUDA_HOME=/nonexistent PATH=/usr/bin:/bin python3 benchmarks/bench_first_use.py --out ..._no_toolkit.json

``first call``: a fresh process per compiler (NVRTC, the library's default; nvcc, where ``--nvcc`` names one)
with empty kernel caches (ours and Triton's) runs ``attention(q, k, v, quant="int8")`` on ``--shape`` twice,
timing each call to its result, and records whether the build's WARNING line reached stderr at the default
log level. ``routes``: which route ``auto`` takes for the default (dense), int8 and fp8 SAGE on that shape,
each call timed against cuDNN and against the SDPA call stock Diffusers makes (``F.scaled_dot_product_attention``
on ``[B, H, S, D]`` views, torch's own backend choice), rel-L1 against fp32 dense on a few heads; the
processor's dense call is ``run_attention`` handed that stock call, as ``TrtllmAttnProcessor`` hands it the
family's own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_sage_sm90 import environment, write_result
from diffusers_trtllm.bench.inputs import parse_shapes, structured_qkv
from diffusers_trtllm.bench.suite import heads_subset
from diffusers_trtllm.bench.timing import time_fn
from diffusers_trtllm.measure import cosine, rel_l1

_CHILD = """
import sys, time, torch
from diffusers_trtllm import run_attention
from diffusers_trtllm.bench.inputs import parse_shapes, structured_qkv
q, k, v = structured_qkv(parse_shapes(sys.argv[1])[0], 0.5, device="cuda", k_mean=4.0)
times, routes = [], []
for _ in range(2):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out, res = run_attention(q, k, v, quant="int8")
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
    routes.append(res.route)
print("RESULT", times[0], times[1], routes[0])
"""


def first_calls(shape: str, nvcc: str | None) -> list[dict]:
    rows = []
    for compiler in ["nvrtc"] + (["nvcc"] if nvcc else []):
        with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as triton_cache:
            env = dict(os.environ, DIFFUSERS_TRTLLM_CACHE=cache, TRITON_CACHE_DIR=triton_cache)
            env.pop("DIFFUSERS_TRTLLM_NVCC", None)
            if compiler == "nvcc":
                env["DIFFUSERS_TRTLLM_NVCC"] = nvcc
            start = time.perf_counter()
            res = subprocess.run([sys.executable, "-c", _CHILD, shape], env=env, capture_output=True, text=True)
            wall = time.perf_counter() - start
            line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT")), None)
            if line is None:
                rows.append(dict(part="first call", compiler=compiler, error=res.stderr[-2000:]))
                continue
            first, second, route = line.split()[1:]
            notes = [x for x in res.stderr.splitlines() if "building" in x]
            rows.append(dict(part="first call", compiler=compiler, route=route, first_s=float(first),
                             second_s=float(second), process_s=wall, warning=notes[0] if notes else None))
        print(rows[-1], flush=True)
    return rows


def routes(shape_name: str, iters: int) -> list[dict]:
    from diffusers_trtllm import run_attention

    shape = parse_shapes(shape_name)[0]
    dev = torch.device("cuda")
    q, k, v = structured_qkv(shape, 0.5, device=dev, k_mean=4.0)
    scale = shape.head_dim**-0.5
    heads = heads_subset(shape.heads, 4)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        ref = F.scaled_dot_product_attention(*(x[:, :, heads].float().transpose(1, 2) for x in (q, k, v)),
                                             scale=scale).transpose(1, 2)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # the views stock Diffusers hands SDPA

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qh, kh, vh, scale=scale).transpose(1, 2)

    def stock_sdpa():
        return F.scaled_dot_product_attention(qh, kh, vh, scale=scale).transpose(1, 2)

    impls = {"cudnn": (cudnn, "cudnn"), "stock SDPA": (stock_sdpa, "torch")}
    # The processor hands run_attention the family's own call: a dense call that would run on sdpa runs it.
    route = run_attention(q, k, v, stock=stock_sdpa)[1].route
    impls["processor's default (dense)"] = (lambda: run_attention(q, k, v, stock=stock_sdpa)[0], route)
    for name, quant in (("default (dense)", None), ("int8", "int8"), ("fp8", "fp8_e4m3")):
        route = run_attention(q, k, v, quant=quant)[1].route
        impls[f"auto {name}"] = (lambda quant=quant: run_attention(q, k, v, quant=quant)[0], route)
    rows, base, stock = [], None, None
    for name, (fn, route) in impls.items():
        out = fn()
        t = time_fn(fn, dev, warmup=3, iters=iters, max_seconds=4.0).median_ms
        base, stock = base or t, stock or (t if name == "stock SDPA" else None)
        o = out[:, :, heads].float()
        rows.append(dict(part="routes", shape=shape.name, impl=name, route=route, ms=t, vs_cudnn=base / t,
                         vs_stock_sdpa=stock / t if stock else None, rel_l1=rel_l1(o, ref), cosine=cosine(o, ref)))
        print(rows[-1], flush=True)
    return rows


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"GPU {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, Triton {env['triton']}, nvcc on PATH: "
             f"{env['nvcc']}, NVRTC: {env['nvrtc']}; `{result['command']}`", "",
             "| compiler | route | first call s | second call s | process s | WARNING line at the default level |",
             "|---|---|---:|---:|---:|---|"]
    for r in (r for r in result["rows"] if r["part"] == "first call"):
        if "error" in r:
            lines.append(f"| {r['compiler']} | failed: {r['error'].splitlines()[-1] if r['error'] else ''} | | | | |")
        else:
            lines.append(f"| {r['compiler']} | {r['route']} | {r['first_s']:.2f} | {r['second_s']:.3f} | "
                         f"{r['process_s']:.1f} | {r['warning'] or 'none'} |")
    lines += ["", "| shape | call | route | ms | vs cuDNN | vs stock SDPA | rel-L1 | cosine |",
              "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in (r for r in result["rows"] if r["part"] == "routes"):
        stock = "" if r["vs_stock_sdpa"] is None else f"{r['vs_stock_sdpa']:.3f}x"
        lines.append(f"| {r['shape']} | {r['impl']} | {r['route']} | {r['ms']:.3f} | {r['vs_cudnn']:.3f}x | {stock} | "
                     f"{r['rel_l1']:.4f} | {r['cosine']:.5f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="wan_14b_480p")
    p.add_argument("--nvcc", default=None, help="also time a cold first call built by this nvcc")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--skip-first-call", action="store_true")
    p.add_argument("--out", default=None, help="JSON results file; a Markdown table is written beside it")
    args = p.parse_args()
    from diffusers_trtllm.kernels import cuda_jit

    rows = [] if args.skip_first_call else first_calls(args.shape, args.nvcc)
    rows += routes(args.shape, args.iters)
    if args.out:
        write_result(args.out, "bench_first_use.py",
                     environment(nvcc=cuda_jit.find_nvcc(), nvrtc=cuda_jit.find_nvrtc()), rows, markdown)


if __name__ == "__main__":
    main()
