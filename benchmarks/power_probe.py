"""Attention right after a burst of large GEMMs, as inside a transformer forward: what the power cap does to it.

    python3 benchmarks/power_probe.py --shape wan_14b_480p --out power_probe.json

Inside a Wan2.1-14B forward the ``sage-sm90`` kernel took 28.7 ms a call where the attention benchmark times
25.7 ms (H200, ``benchmarks/results/profile_e2e_h200_480p.md``), and on the recorded call's own Q, K, V it takes
the benchmark's time (``e2e_attention_probe.py``). The difference is the GPU's state: a forward's GEMMs run the
GPU at its power limit, and the clock it then runs at (NVML's, read after each timed call) holds through the
attention call that follows. Each row times one attention call after ``before`` bf16 GEMMs of a Wan2.1-14B
projection's shape (none: the GPU idle, as the attention benchmark times it), or after two seconds of the same
call back to back (the clock its own power draw allows), the median of ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers_trtllm.bench.external import BASELINE_CUDA, external_impls  # noqa: E402
from diffusers_trtllm.bench.inputs import SHAPES, structured_qkv  # noqa: E402
from diffusers_trtllm.bench.suite import heads_subset  # noqa: E402
from diffusers_trtllm.config import QuantConfig  # noqa: E402
from diffusers_trtllm.kernels.sage_sm90 import sage_sm90_attention, sage_sm90_quantize  # noqa: E402
from diffusers_trtllm.layout import PackedLayout  # noqa: E402
from diffusers_trtllm.measure import threshold_for, tile_criticals  # noqa: E402

BURSTS = (0, 10, 40)
#: The ``gemms_before`` of rows timed after two seconds of the same call back to back.
SUSTAINED = -1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="wan_14b_480p", choices=sorted(SHAPES))
    p.add_argument("--target-skip", type=float, default=0.4, help="the skip row's target fraction of tiles")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    shape = SHAPES[args.shape]
    q, k, v = (x[0].contiguous() for x in structured_qkv(shape, 0.5, device=dev, reach_spread=1.0))
    layout = PackedLayout.dense(1, q.shape[0], k.shape[0], dev)
    quant = QuantConfig("int8")  # the route's default: K blocks of 128 split per thread, smooth_k
    scale = shape.head_dim**-0.5
    quantized = sage_sm90_quantize(q, k, v, layout, quant)
    heads = heads_subset(shape.heads, 4)  # as the attention benchmark finds its skip factors
    lam = threshold_for(tile_criticals(q[:, heads], k[:, heads], scale, 64, 128), args.target_skip)
    calls, baselines = {}, external_impls(dev, q.dtype)
    for label, name in (("cudnn", BASELINE_CUDA), ("sageattn", "sageattn")):
        prepare, missing = baselines[name]
        if missing:
            print(f"{label} unavailable: {missing}")
        else:
            calls[label] = prepare(q[None], k[None], v[None], scale)
    calls["sage-sm90"] = lambda: sage_sm90_attention(q, k, v, layout, softmax_scale=scale, quant=quant)
    calls["sage-sm90 kernel only"] = lambda: sage_sm90_attention(q, k, v, layout, softmax_scale=scale, quant=quant,
                                                                 quantized=quantized)
    if lam is not None:
        calls[f"sage-sm90 skip {args.target_skip:.0%}"] = lambda: sage_sm90_attention(
            q, k, v, layout, softmax_scale=scale, quant=quant, skip_factor=lam * k.shape[0])
    x = torch.randn(shape.tokens, 5120, device=dev, dtype=torch.bfloat16)
    w = torch.randn(5120, 5120, device=dev, dtype=torch.bfloat16)
    for fn in calls.values():
        fn()

    rows = []
    for before in (*BURSTS, SUSTAINED):
        for name, fn in calls.items():
            times, clocks, power = [], [], []
            if before == SUSTAINED:  # the call alone, back to back: the clock its own power draw allows
                start = time.monotonic()
                while time.monotonic() - start < 2.0:
                    fn()
                    torch.cuda.synchronize()
            for _ in range(args.rounds):
                for _ in range(before if before != SUSTAINED else 0):
                    x @ w
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
                clocks.append(torch.cuda.clock_rate())
                power.append(torch.cuda.power_draw() / 1000)
            ms, watts = statistics.median(times), statistics.median(power)
            rows.append({"gemms_before": before, "call": name, "ms": ms, "sm_clock_mhz": statistics.median(clocks),
                         "power_w": watts, "joules": watts * ms / 1000})
            print(rows[-1], flush=True)
    base = {r["gemms_before"]: r["ms"] for r in rows if r["call"] == "cudnn"}
    for r in rows:
        r["vs_cudnn"] = base[r["gemms_before"]] / r["ms"]
    if args.out is not None:
        result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
                  "shape": args.shape, "rows": rows}
        args.out.write_text(json.dumps(result, indent=1))
        args.out.with_suffix(".md").write_text(markdown(result))


def markdown(result: dict) -> str:
    lines = [f"GPU {result['gpu']}, torch {result['torch']}, {result['shape']}; `{result['command']}`", "",
             "`before`: the bf16 GEMMs run before each timed call, or `same call` for rows timed after two seconds of "
             "that call back to back. Clock and power: NVML's, read after each call (power is NVML's running "
             "average); `J`: power x time.", "",
             "| before | call | ms | vs cuDNN | SM clock (MHz) | power (W) | J |", "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {'same call' if r['gemms_before'] == SUSTAINED else r['gemms_before']} | {r['call']} | {r['ms']:.2f} "
              f"| {r['vs_cudnn']:.3f}x | {r['sm_clock_mhz']:.0f} | {r['power_w']:.0f} | {r['joules']:.2f} |"
              for r in result["rows"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
