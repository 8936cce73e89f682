"""What Wan's rotary embedding costs a self-attention call, stock against our one launch (``kernels.rotary``).

    python3 benchmarks/bench_rotary.py --shapes wan_14b_480p,wan_14b_720p --out rotary.json

On a full-size Wan2.1-14B self-attention module (random weights, bf16), Diffusers' own ``WanAttnProcessor`` is
timed with its rotary embedding and without (its attention call replaced by a copy of Q, so the difference is
the rotation alone, the projections and QK norms the same in both), beside :func:`rotate_interleaved` on the
same Q and K, and its outputs are compared with the stock processor's bit for bit. Writes JSON and a Markdown
table next to it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers_trtllm.bench.inputs import SHAPES  # noqa: E402
from diffusers_trtllm.bench.report import environment  # noqa: E402
from diffusers_trtllm.bench.timing import time_fn  # noqa: E402
from diffusers_trtllm.kernels.rotary import fused_rotary_reasons, rotate_interleaved  # noqa: E402

#: Wan2.1-14B's attention: model width and heads.
WAN_14B_DIM, WAN_14B_HEADS = 5120, 40


def measure(shape_name: str, device: torch.device, iters: int) -> dict:
    from diffusers.models.transformers import transformer_wan

    tokens, head_dim = SHAPES[shape_name].tokens, WAN_14B_DIM // WAN_14B_HEADS
    attn = transformer_wan.WanAttention(WAN_14B_DIM, heads=WAN_14B_HEADS, dim_head=head_dim, eps=1e-6)
    attn = attn.to(device, torch.bfloat16).eval()
    processor = transformer_wan.WanAttnProcessor()
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(1, tokens, WAN_14B_DIM, device=device, dtype=torch.bfloat16, generator=g)
    angle = torch.rand(1, tokens, 1, head_dim // 2, device=device, generator=g) * 100
    freqs = (angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1))
    seen: dict[str, torch.Tensor] = {}

    def record(query, key, value, **kwargs):  # the attention call, replaced: Q and K as the processor rotated them
        seen["q"], seen["k"] = query, key
        return query.clone()

    original = transformer_wan.dispatch_attention_fn
    transformer_wan.dispatch_attention_fn = record
    try:
        with torch.no_grad():
            processor(attn, hidden, rotary_emb=None)
            q, k = seen["q"], seen["k"]
            processor(attn, hidden, rotary_emb=freqs)
            stock_q, stock_k = seen["q"], seen["k"]
            with_rope = time_fn(lambda: processor(attn, hidden, rotary_emb=freqs), device, iters=iters).median_ms
            without = time_fn(lambda: processor(attn, hidden, rotary_emb=None), device, iters=iters).median_ms
            ours_q, ours_k = rotate_interleaved(q, k, *freqs)
            ours = time_fn(lambda: rotate_interleaved(q, k, *freqs), device, iters=iters).median_ms
    finally:
        transformer_wan.dispatch_attention_fn = original
    return {
        "shape": shape_name, "tokens": tokens, "heads": WAN_14B_HEADS, "head_dim": head_dim,
        "stock_processor_ms": with_rope, "stock_processor_without_rotary_ms": without,
        "stock_rotary_ms": with_rope - without, "ours_ms": ours, "fused": not fused_rotary_reasons(q, k, *freqs),
        "bit_equal": bool(torch.equal(ours_q, stock_q) and torch.equal(ours_k, stock_k)),
    }


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"GPU {env.get('gpu')}, torch {env['torch']}, Triton {env.get('triton')}, Diffusers {env.get('diffusers')}; "
             f"`{result['command']}`", "",
             "One Wan2.1-14B self-attention call (bf16, batch 1): Diffusers' `WanAttnProcessor` with and without its "
             "rotary embedding (attention call replaced by a copy of Q; the difference is the rotation), and "
             "`rotate_interleaved` (Q and K in one launch) on the same Q and K. `bit-equal`: our Q and K equal the "
             "stock processor's.", "",
             "| shape | tokens | stock processor (ms) | without rotary (ms) | stock rotation (ms) | ours (ms) | "
             "saved a call (ms) | bit-equal |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['shape']} | {r['tokens']} | {r['stock_processor_ms']:.2f} | {r['stock_processor_without_rotary_ms']:.2f} "
              f"| {r['stock_rotary_ms']:.2f} | {r['ours_ms']:.3f} | {r['stock_rotary_ms'] - r['ours_ms']:.2f} "
              f"| {'yes' if r['bit_equal'] else '**no**'} |" for r in result["rows"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="wan_14b_480p,wan_14b_720p")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("rotary.json"))
    args = parser.parse_args()
    device = torch.device("cuda")
    result = {"environment": environment(str(device)), "command": "python3 benchmarks/bench_rotary.py " + " ".join(sys.argv[1:]),
              "rows": [measure(name, device, args.iters) for name in args.shapes.split(",")]}
    args.out.write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
