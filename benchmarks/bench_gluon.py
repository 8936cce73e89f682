"""Sweep the Gluon kernel's schedule knobs on one shape (issue 12), against the ``triton`` route and cuDNN.

    python benchmarks/bench_gluon.py --shape wan_14b_480p

Per configuration (``KNOBS``: consumer warpgroups, stages, KV tile, schedule, register cap): dense bf16, skip-softmax (threshold that makes
the ``triton`` route skip about half its tiles) and int8 SAGE, whole call including quantization;
``vs cuDNN`` is cuDNN's time over this time, ``diff`` the rel-L1 against the ``triton`` route's
output for the same work (a cheap check that the kernel agrees; the GPU tests check the reference).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_triton import median_ms  # noqa: E402

from diffusers_trtllm.bench.inputs import parse_shapes, structured_qkv  # noqa: E402
from diffusers_trtllm.measure import rel_l1  # noqa: E402
from diffusers_trtllm.config import QuantConfig  # noqa: E402
from diffusers_trtllm.kernels.gluon_attn import GluonConfig, gluon_attention  # noqa: E402
from diffusers_trtllm.kernels.triton_attn import triton_attention  # noqa: E402
from diffusers_trtllm.layout import PackedLayout  # noqa: E402

#: Configurations swept: name -> overrides of ``GluonConfig()`` (two consumers, 2 stages, in order).
KNOBS = {
    "c2 s2 inorder": {},
    "c2 s2 fa3": dict(schedule="fa3"),
    "c1 s2 fa3 r240": dict(schedule="fa3", consumers=1, maxnreg=240),
    "c2 s2 lookahead": dict(schedule="lookahead"),
    "c1 s2 inorder r240": dict(consumers=1, maxnreg=240),
    "c2 s3 inorder": dict(stages=3),
    "c2 s3 fa3": dict(schedule="fa3", stages=3),
    "c2 s4 n64 fa3": dict(schedule="fa3", stages=4, block_n=64),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="wan_14b_480p")
    p.add_argument("--locality", type=float, default=0.5)
    args = p.parse_args()
    shape = parse_shapes(args.shape)[0]
    q4, k4, v4 = structured_qkv(shape, args.locality, device="cuda")
    b, s, h, d = q4.shape
    layout = PackedLayout.dense(b, s, k4.shape[1], "cuda")
    q, k, v = (x.reshape(-1, *x.shape[2:]) for x in (q4, k4, v4))
    scale = d**-0.5
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        qt, kt, vt = (x.transpose(1, 2) for x in (q4, k4, v4))
        cudnn = median_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, scale=scale))
    # the threshold at which the triton route skips about half its tiles
    lo, hi = 1e-4, 10.0
    for _ in range(12):
        mid = (lo * hi) ** 0.5
        res = triton_attention(q, k, v, layout, softmax_scale=scale, skip_factor=mid * s, collect_stats=True)
        lo, hi = (mid, hi) if res.skipped_tiles < 0.5 * res.total_tiles else (lo, mid)
    factor = hi * s
    int8 = QuantConfig("int8", 1, 16)
    works = {"dense": dict(), "skip": dict(skip_factor=factor), "int8": dict(quant=int8),
             "int8+skip": dict(quant=int8, skip_factor=factor)}
    print(f"{shape.name}: cuDNN {cudnn:.3f} ms; skip factor {factor:.4g}")
    print(f"{'impl':28s} {'work':10s} {'ms':>8s} {'vs cuDNN':>8s} {'skipped':>8s} {'diff':>8s}")
    for work, kw in works.items():
        ref = triton_attention(q, k, v, layout, softmax_scale=scale, collect_stats=True, **kw)
        ms = median_ms(lambda: triton_attention(q, k, v, layout, softmax_scale=scale, **kw))
        frac = (ref.skipped_tiles or 0) / ref.total_tiles
        print(f"{'triton':28s} {work:10s} {ms:8.3f} {cudnn / ms:8.2f} {frac:8.2f} {'':>8s}")
        for knob, overrides in KNOBS.items():
            cfg = replace(GluonConfig(), **overrides)
            name = f"gluon {knob}"
            try:
                res = gluon_attention(q, k, v, layout, softmax_scale=scale, collect_stats=True, config=cfg, **kw)
                ms = median_ms(lambda: gluon_attention(q, k, v, layout, softmax_scale=scale, config=cfg, **kw))
            except Exception as exc:  # report and go on: one bad configuration must not hide the others
                print(f"{name:28s} {work:10s} failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            frac = (res.skipped_tiles or 0) / res.total_tiles
            print(f"{name:28s} {work:10s} {ms:8.3f} {cudnn / ms:8.2f} {frac:8.2f} {rel_l1(res.out, ref.out):8.4f}")


if __name__ == "__main__":
    main()
