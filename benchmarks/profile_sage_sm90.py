"""One ``sage-sm90`` call on a standard shape, for ``ncu`` (the first call builds and warms up; profile the second).

    ncu --clock-control none -k regex:sage_sm90_d --launch-skip 1 -c 1 --set full \\
        python3 benchmarks/profile_sage_sm90.py --shape wan_1.3b_480p [--define SAGE_SM90_PINGPONG=0] [--skip 0.0] \\
        [--k-block 128]
"""

from __future__ import annotations

import argparse

import torch

from diffusers_trtllm.bench.inputs import SHAPES, structured_qkv
from diffusers_trtllm.config import QuantConfig
from diffusers_trtllm.kernels.sage_sm90 import sage_sm90_attention
from diffusers_trtllm.layout import PackedLayout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="wan_1.3b_480p", choices=sorted(SHAPES))
    p.add_argument("--define", action="append", default=[])
    p.add_argument("--skip", type=float, default=None, help="skip_factor (None: the dense kernel)")
    p.add_argument("--k-block", type=int, default=16, help="SAGE's k_block_size")
    args = p.parse_args()
    shape = SHAPES[args.shape]
    q, k, v = (x[0].contiguous() for x in structured_qkv(shape, 0.5, device="cuda"))
    layout = PackedLayout.dense(1, q.shape[0], k.shape[0], q.device)
    for _ in range(2):
        sage_sm90_attention(q, k, v, layout, softmax_scale=shape.head_dim**-0.5, quant=QuantConfig("int8", 1, args.k_block),
                            skip_factor=args.skip, defines=tuple(args.define))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
