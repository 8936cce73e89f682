"""What a rotary embedding costs a self-attention call, stock against our one launch (``kernels.rotary``).

    python3 benchmarks/bench_rotary.py --shapes wan_14b_480p,wan_14b_720p,flux_1024 --out rotary.json

On a full-size attention module of the shape's family (random weights, bf16: Wan2.1-14B's for ``wan_*``,
Flux.1-dev's single-stream block for ``flux_*``), Diffusers' own processor is timed with its rotary embedding and
without (its attention call replaced by a copy of Q, so the difference is the rotation alone, the projections and
QK norms the same in both), beside :func:`rotate_interleaved` on the same Q and K under the family's rule, and its
outputs are compared with the stock processor's bit for bit. Writes JSON and a Markdown table next to it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers_trtllm.bench.inputs import SHAPES  # noqa: E402
from diffusers_trtllm.bench.report import environment  # noqa: E402
from diffusers_trtllm.bench.timing import time_fn  # noqa: E402
from diffusers_trtllm.kernels.rotary import fused_rotary_reasons, rotate_interleaved  # noqa: E402


@dataclass(frozen=True)
class Family:
    """A family's attention module and processor at full size, and how it takes its rotary tables."""

    module: str       # the Diffusers module whose dispatch_attention_fn the processor calls
    build: Callable[[], tuple[torch.nn.Module, Any]]  # (attention module, stock processor)
    width: int        # the module's input width
    argument: str     # the processor's rotary parameter
    rule: str         # kernels.rotary's rule
    tables: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # [S, D] tables as passed


def _wan():
    from diffusers.models.transformers import transformer_wan

    return transformer_wan.WanAttention(5120, heads=40, dim_head=128, eps=1e-6), transformer_wan.WanAttnProcessor()


def _flux():
    from diffusers.models.transformers import transformer_flux

    attn = transformer_flux.FluxAttention(query_dim=3072, heads=24, dim_head=128, out_dim=3072, bias=True, eps=1e-6,
                                          pre_only=True)
    return attn, transformer_flux.FluxAttnProcessor()


FAMILIES = {
    "wan": Family("diffusers.models.transformers.transformer_wan", _wan, 5120, "rotary_emb", "pair",
                  lambda cos, sin: (cos[None, :, None, :], sin[None, :, None, :])),
    "flux": Family("diffusers.models.transformers.transformer_flux", _flux, 3072, "image_rotary_emb", "element",
                   lambda cos, sin: (cos, sin)),
}


def measure(shape_name: str, device: torch.device, iters: int) -> dict:
    import importlib

    family = FAMILIES[shape_name.split("_")[0]]
    module = importlib.import_module(family.module)
    tokens, head_dim = SHAPES[shape_name].tokens, SHAPES[shape_name].head_dim
    attn, processor = family.build()
    attn = attn.to(device, torch.bfloat16).eval()
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(1, tokens, family.width, device=device, dtype=torch.bfloat16, generator=g)
    angle = torch.rand(tokens, head_dim // 2, device=device, generator=g) * 100
    tables = family.tables(angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1))
    kernel_tables = tuple(t if t.ndim == 4 else t[None, :, None, :] for t in tables)
    seen: dict[str, torch.Tensor] = {}

    def record(query, key, value, **kwargs):  # the attention call, replaced: Q and K as the processor rotated them
        seen["q"], seen["k"] = query, key
        return query.clone()

    def run(rotary):
        return processor(attn, hidden, **{family.argument: rotary})

    original = module.dispatch_attention_fn
    module.dispatch_attention_fn = record
    try:
        with torch.no_grad():
            run(None)
            q, k = seen["q"], seen["k"]
            run(tables)
            stock_q, stock_k = seen["q"], seen["k"]
            with_rope = time_fn(lambda: run(tables), device, iters=iters).median_ms
            without = time_fn(lambda: run(None), device, iters=iters).median_ms
            ours_q, ours_k = rotate_interleaved(q, k, *kernel_tables, rule=family.rule)
            ours = time_fn(lambda: rotate_interleaved(q, k, *kernel_tables, rule=family.rule), device,
                           iters=iters).median_ms
    finally:
        module.dispatch_attention_fn = original
    return {
        "shape": shape_name, "tokens": tokens, "heads": q.shape[2], "head_dim": head_dim, "rule": family.rule,
        "stock_processor_ms": with_rope, "stock_processor_without_rotary_ms": without,
        "stock_rotary_ms": with_rope - without, "ours_ms": ours, "fused": not fused_rotary_reasons(q, k, *kernel_tables),
        "bit_equal": bool(torch.equal(ours_q, stock_q) and torch.equal(ours_k, stock_k)),
    }


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"GPU {env.get('gpu')}, torch {env['torch']}, Triton {env.get('triton')}, Diffusers {env.get('diffusers')}; "
             f"`{result['command']}`", "",
             "One self-attention call (bf16, batch 1; Wan2.1-14B's for `wan_*`, a Flux.1-dev single-stream block's "
             "for `flux_*`): Diffusers' processor with and without its rotary embedding (attention call replaced by a "
             "copy of Q; the difference is the rotation), and `rotate_interleaved` (Q and K in one launch) on the "
             "same Q and K. `bit-equal`: our Q and K equal the stock processor's.", "",
             "| shape | tokens | stock processor (ms) | without rotary (ms) | stock rotation (ms) | ours (ms) | "
             "saved a call (ms) | bit-equal |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['shape']} | {r['tokens']} | {r['stock_processor_ms']:.2f} | {r['stock_processor_without_rotary_ms']:.2f} "
              f"| {r['stock_rotary_ms']:.2f} | {r['ours_ms']:.3f} | {r['stock_rotary_ms'] - r['ours_ms']:.2f} "
              f"| {'yes' if r['bit_equal'] else '**no**'} |" for r in result["rows"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="wan_14b_480p,wan_14b_720p,flux_1024")
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
