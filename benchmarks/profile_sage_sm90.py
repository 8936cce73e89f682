"""One ``sage-sm90`` call on a standard shape, for ``ncu`` (the first call builds and warms up; profile the second).

    ncu --clock-control none -k regex:sage_sm90_d --launch-skip 1 -c 1 --set full \\
        python3 benchmarks/profile_sage_sm90.py --shape wan_1.3b_480p [--define SAGE_SM90_PINGPONG=1] [--skip 0.0 | --target-skip 0.4] \\
        [--k-block 128] [--reach-spread 1]
"""

from __future__ import annotations

import argparse

import torch

from bench_sage_sm90 import SKIP_PROBES
from diffusers_trtllm.bench.inputs import SHAPES, structured_qkv
from diffusers_trtllm.bench.suite import heads_subset
from diffusers_trtllm.config import QuantConfig
from diffusers_trtllm.kernels.sage_sm90 import BLOCK_M, BLOCK_N, sage_sm90_attention
from diffusers_trtllm.layout import PackedLayout
from diffusers_trtllm.measure import threshold_for, tile_criticals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="wan_1.3b_480p", choices=sorted(SHAPES))
    p.add_argument("--define", action="append", default=[])
    p.add_argument("--skip", type=float, default=None, help="skip_factor (None: the dense kernel)")
    p.add_argument("--target-skip", type=float, default=None,
                   help="instead of --skip: the skip_factor at which the reference skips this fraction of tiles")
    p.add_argument("--k-block", type=int, default=16, help="SAGE's k_block_size")
    p.add_argument("--reach-spread", type=float, default=0.0, help="heads' reach differing by this many octaves")
    args = p.parse_args()
    shape = SHAPES[args.shape]
    q, k, v = (x[0].contiguous() for x in structured_qkv(shape, 0.5, device="cuda", reach_spread=args.reach_spread))
    layout = PackedLayout.dense(1, q.shape[0], k.shape[0], q.device)
    scale = shape.head_dim**-0.5
    skip = args.skip
    if args.target_skip == 0:  # the skip build voting on every tile and skipping none (a factor of 0 would run
        skip = SKIP_PROBES["+skiptiny"]  # the kernel without skip)
    elif args.target_skip is not None:
        heads = heads_subset(shape.heads, 4)
        skip = threshold_for(tile_criticals(q[:, heads], k[:, heads], scale, BLOCK_M, BLOCK_N), args.target_skip)
        skip = None if skip is None else skip * k.shape[0]
    for _ in range(2):
        res = sage_sm90_attention(q, k, v, layout, softmax_scale=scale, quant=QuantConfig("int8", 1, args.k_block),
                                  skip_factor=skip, defines=tuple(args.define), collect_stats=skip is not None)
    torch.cuda.synchronize()
    if skip is not None:
        print(f"skip_factor {skip:.4g}: the kernel skipped {res.skipped_tiles / res.total_tiles:.3f} of its tiles")


if __name__ == "__main__":
    main()
