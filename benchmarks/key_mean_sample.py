"""What the size of K's mean sample (``reference.KEY_MEAN_SAMPLE``) costs and what it buys (CUDA GPU, sm_90).

    python3 benchmarks/key_mean_sample.py --shapes flux_1024,flux_2048=1:16896:24:128 --samples 4096,1024,512 --out X.json

``smooth_k`` takes K's per-channel mean off before int8; any vector leaves softmax as it is, so the mean is taken over
an even sample of the keys, which the quantizer's first launch reads beside V. Per sample size: the quantizer alone
(GPU-bound, launches queued behind a sleep) and the ``sage-sm90`` call's accuracy against fp32 dense attention, on
keys with a per-channel mean (``--k-mean`` standard deviations), as trained models' keys have.
"""

from __future__ import annotations

import argparse

import torch
from bench_sage_sm90 import environment, write_result
from cta_cost import gpu_ms

from diffusers_trtllm.bench.inputs import parse_shapes, structured_qkv
from diffusers_trtllm.config import QuantConfig
from diffusers_trtllm.kernels import triton_quant
from diffusers_trtllm.kernels.sage_sm90 import sage_sm90_attention, sage_sm90_quantize
from diffusers_trtllm.layout import PackedLayout
from diffusers_trtllm.measure import cosine, rel_l1


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"GPU {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, Triton {env['triton']}; "
             f"`{result['command']}`", "",
             "| shape | KEY_MEAN_SAMPLE | keys read | quantizer ms | rel-L1 | cosine |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['shape']} | {r['sample']} | {r['keys_read']} | {r['quantizer_ms']:.4f} | {r['rel_l1']:.4f} | "
              f"{r['cosine']:.5f} |" for r in result["rows"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="flux_1024,flux_2048=1:16896:24:128")
    p.add_argument("--samples", default="4096,1024,512", help="KEY_MEAN_SAMPLE values, comma-separated")
    p.add_argument("--k-mean", type=float, default=4.0, help="K's per-channel mean, in standard deviations")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=None, help="JSON results; a Markdown table is written beside it")
    args = p.parse_args()
    dev = torch.device("cuda")
    quant = QuantConfig("int8", smooth_k=True)
    rows = []
    for shape in parse_shapes(args.shapes):
        q, k, v = structured_qkv(shape, 0.5, device=dev, k_mean=args.k_mean)
        ref = torch.nn.functional.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v)))
        ref = ref.transpose(1, 2).reshape(-1, shape.heads, shape.head_dim)
        packed = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
        layout = PackedLayout.dense(shape.batch, shape.tokens, shape.kv_len, dev)
        for sample in map(int, args.samples.split(",")):
            triton_quant.KEY_MEAN_SAMPLE = sample  # the quantizer's step: max(1, keys // sample)
            ms = gpu_ms(lambda: sage_sm90_quantize(*packed, layout, quant), args.iters)
            out = sage_sm90_attention(*packed, layout, softmax_scale=shape.head_dim ** -0.5, quant=quant)
            keys = packed[1].shape[0]
            row = dict(shape=shape.name, sample=sample, keys_read=-(-keys // max(1, keys // sample)), quantizer_ms=ms,
                       rel_l1=rel_l1(out.out, ref), cosine=cosine(out.out, ref))
            rows.append(row)
            print(row, flush=True)
    if args.out:
        write_result(args.out, "key_mean_sample.py", environment(), rows, markdown)


if __name__ == "__main__":
    main()
