"""Where one attention call's host (CPU) time goes: per part, with the GPU kept busy, and a cProfile of the call.

    python3 benchmarks/host_profile.py --shapes flux_1024,flux_2048=1:16896:24:128 --out X.json

Issue 57's host side: ``profile_call.py`` gives one call's CPU time; this splits it (the quantizer alone, the
kernel with the quantized inputs given, the whole call), counts the calls that took Triton's own launch path
(``JITFunction.run``) instead of ``triton_launch``'s direct one, gives a timeline of the int8 call and of the
quantizer (each launch's start and end from the call's start, median CPU microseconds), and lists the functions
that cost the most. Each part runs ``--calls`` times back to back behind a GPU sleep, so no launch waits for the GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from profile_call import host_times

from diffusers_trtllm import attention
from diffusers_trtllm.bench.inputs import parse_shapes, structured_qkv
from diffusers_trtllm.config import QuantConfig
from diffusers_trtllm.kernels.sage_sm90 import sage_sm90_attention, sage_sm90_quantize
from diffusers_trtllm.layout import PackedLayout


def cpu_us(fn, calls: int) -> float:
    """CPU microseconds per call of ``fn``, issued behind a GPU sleep long enough that nothing waits."""
    return host_times(fn, calls, sleep_cycles=int(2e9))[1]


def slow_launches(fn, calls: int) -> int:
    """How many of ``calls`` calls' Triton launches went through ``JITFunction.run`` (not the direct path)."""
    from triton.runtime.jit import JITFunction

    count, original = [0], JITFunction.run

    def counted(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)

    JITFunction.run = counted
    try:
        for _ in range(calls):
            fn()
    finally:
        JITFunction.run = original
    torch.cuda.synchronize()
    return count[0]


def timeline(fn, calls: int) -> dict[str, float]:
    """Median CPU microseconds from a call's start to each of its launches' start and end and to its return, the
    GPU kept busy (our Triton launches and the CUDA kernel's; a route launching elsewhere shows none)."""
    from diffusers_trtllm.kernels import cuda_jit, triton_quant

    stamps: list[int] = []

    def timed(launch):
        def call(*args, **kwargs):
            stamps.append(time.perf_counter_ns())
            launch(*args, **kwargs)
            stamps.append(time.perf_counter_ns())
        return call

    bound = getattr(triton_quant, "BoundLaunch", None)  # the quantizer's launches (a package before it: launch)
    saved = triton_quant.launch, cuda_jit.CudaKernel.launch, bound and bound.__call__
    triton_quant.launch, cuda_jit.CudaKernel.launch = timed(saved[0]), timed(saved[1])
    if bound:
        bound.__call__ = timed(saved[2])
    per_call = []
    try:
        fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9))
        for _ in range(calls):
            stamps.clear()
            start = time.perf_counter_ns()
            fn()
            per_call.append([(t - start) / 1e3 for t in (*stamps, time.perf_counter_ns())])
    finally:
        triton_quant.launch, cuda_jit.CudaKernel.launch = saved[:2]
        if bound:
            bound.__call__ = saved[2]
    torch.cuda.synchronize()
    names = [f"launch {i // 2 + 1} {('start', 'end')[i % 2]}" for i in range(len(per_call[0]) - 1)] + ["return"]
    return {name: statistics.median(c[i] for c in per_call) for i, name in enumerate(names)}


def profile(fn, calls: int, top: int) -> str:
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="flux_1024,flux_2048=1:16896:24:128")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    for shape in parse_shapes(args.shapes):
        q, k, v = structured_qkv(shape, 0.5, device=dev, k_mean=4.0)
        scale = shape.head_dim**-0.5
        packed = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
        layout = PackedLayout.dense(shape.batch, shape.tokens, shape.kv_len, device=dev)
        quant = QuantConfig("int8")
        quantized = sage_sm90_quantize(*packed, layout, quant)
        parts = {
            "default": lambda: attention(q, k, v),
            "int8 call": lambda: attention(q, k, v, quant="int8", backend="sage-sm90", policy="always"),
            "quantizer": lambda: sage_sm90_quantize(*packed, layout, quant),
            "kernel, quantized given": lambda: sage_sm90_attention(*packed, layout, softmax_scale=scale, quant=quant,
                                                                   quantized=quantized),
        }
        with torch.inference_mode():
            for name, fn in parts.items():
                row = dict(shape=shape.name, part=name, cpu_us=cpu_us(fn, args.calls),
                           slow_launches_per_call=slow_launches(fn, 20) / 20)
                rows.append(row)
                print(json.dumps(row), flush=True)
            for name in ("int8 call", "quantizer"):
                row = dict(shape=shape.name, part=f"{name} timeline", us=timeline(parts[name], args.calls))
                rows.append(row)
                print(json.dumps(row), flush=True)
            print(f"== cProfile, {shape.name}, int8 call x {args.calls}")
            print(profile(parts["int8 call"], args.calls, args.top), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(command=" ".join(["python3", *sys.argv]), rows=rows), indent=1))


if __name__ == "__main__":
    main()
