"""One attention call per configuration, for Nsight Compute: what bounds each kernel.

    bash benchmarks/profile_attention.sh            # on the H200: ncu over every configuration below

Runs each configuration twice on ``structured_qkv`` inputs (the first call compiles and
warms up; ncu profiles the second, see the shell script's ``--launch-skip``), with
``policy="always"`` so the route asked for is the route that runs. ``--list`` prints the
configurations; ``--only NAME`` runs one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers_trtllm import run_attention  # noqa: E402
from diffusers_trtllm.bench.inputs import parse_shapes, structured_qkv  # noqa: E402

#: name -> (backend, quant dtype or None, skip threshold or None). 0.00507 skips half the 64x128
#: tiles of wan_14b_480p at locality 0.5 (benchmarks/results/hopper_h200.md).
CONFIGS: dict[str, tuple[str, str | None, float | None]] = {
    "fa3-dense": ("fa3", None, None),
    "triton-dense": ("triton", None, None),
    "triton-skip50": ("triton", None, 0.00507),
    "triton-int8": ("triton", "int8", None),
    "triton-int8-skip50": ("triton", "int8", 0.00507),
    "fmha-v2-fp8": ("fmha-v2-fp8", "fp8_e4m3", None),
    "gluon-dense": ("gluon", None, None),
    "gluon-skip50": ("gluon", None, 0.00507),
    "gluon-int8": ("gluon", "int8", None),
    "gluon-int8-skip50": ("gluon", "int8", 0.00507),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="wan_14b_480p")
    p.add_argument("--only", choices=sorted(CONFIGS), default=None)
    p.add_argument("--list", action="store_true")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(CONFIGS))
        return
    (shape,) = parse_shapes(args.shape)
    q, k, v = structured_qkv(shape, 0.5, device="cuda")
    for name in [args.only] if args.only else CONFIGS:
        backend, quant, threshold = CONFIGS[name]
        for _ in range(2):
            out, result = run_attention(q, k, v, backend=backend, quant=quant, skip=threshold, policy="always")
        torch.cuda.synchronize()
        print(f"{name}: route {result.route}, output {tuple(out.shape)}")


if __name__ == "__main__":
    main()
