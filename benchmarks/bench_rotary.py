"""What a rotary embedding costs a self-attention call, stock against our one launch (``kernels.rotary``).

    python3 benchmarks/bench_rotary.py --shapes wan_14b_480p,wan_14b_720p,flux_1024 --out rotary.json

On a full-size attention module of the shape's family (random weights, bf16: Wan2.1-14B's for ``wan_*``,
Flux.1-dev's single-stream block for ``flux_*``, HunyuanVideo's single-stream block with its 256 text tokens for
``hunyuanvideo_*``, LTX-Video's self-attention for ``ltx_*``, Qwen-Image's joint attention with its 256 text tokens
for ``qwenimage_*``, CogVideoX-5B's with its 226 for ``cogvideox_*``), Diffusers' own processor is timed with its rotary
embedding and without (its attention call replaced by a copy of Q, so the difference is the rotation alone, the
projections and QK norms the same in both), beside what our processor runs in its stead on the same Q and K (the
family's ``serving.rotary.DEFERRED`` entry: :func:`rotate_interleaved` under the family's rule), and its outputs are
compared with the stock processor's bit for bit. Writes JSON and a Markdown table next to it.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers_trtllm.bench.inputs import SHAPES  # noqa: E402
from diffusers_trtllm.bench.report import per_shape_main  # noqa: E402
from diffusers_trtllm.bench.timing import time_fn  # noqa: E402
from diffusers_trtllm.serving.rotary import DEFERRED  # noqa: E402


@dataclass(frozen=True)
class Family:
    """A family's attention module and processor at full size, and how it takes its rotary tables."""

    module: str       # the Diffusers module whose dispatch_attention_fn (or F, ``sdpa``) the processor calls
    build: Callable[[], tuple[torch.nn.Module, Any]]  # (attention module, stock processor)
    width: int        # the module's input width
    argument: str     # the processor's rotary parameter
    rule: str         # kernels.rotary's rule
    #: The processor's tables from ``[S, D]`` cosines and sines of the image's (or video's) ``S`` tokens and then the
    #: text's (rows the family does not turn are left out).
    tables: Callable[[torch.Tensor, torch.Tensor, int], Any]
    text_tokens: int = 0  # text tokens the processor joins to the video's (HunyuanVideo's after, the others' before)
    sdpa: bool = False  # the processor calls F.scaled_dot_product_attention ([B, H, S, D]), not dispatch_attention_fn


def _wan():
    from diffusers.models.transformers import transformer_wan

    return transformer_wan.WanAttention(5120, heads=40, dim_head=128, eps=1e-6), transformer_wan.WanAttnProcessor()


def _flux():
    from diffusers.models.transformers import transformer_flux

    attn = transformer_flux.FluxAttention(query_dim=3072, heads=24, dim_head=128, out_dim=3072, bias=True, eps=1e-6,
                                          pre_only=True)
    return attn, transformer_flux.FluxAttnProcessor()


def _hunyuanvideo():
    from diffusers.models.attention_processor import Attention
    from diffusers.models.transformers import transformer_hunyuan_video

    processor = transformer_hunyuan_video.HunyuanVideoAttnProcessor2_0()
    attn = Attention(query_dim=3072, cross_attention_dim=None, dim_head=128, heads=24, out_dim=3072, bias=True,
                     processor=processor, qk_norm="rms_norm", eps=1e-6, pre_only=True)
    return attn, processor


def _ltx():
    from diffusers.models.transformers import transformer_ltx

    attn = transformer_ltx.LTXAttention(query_dim=2048, heads=32, kv_heads=32, dim_head=64, bias=True,
                                        cross_attention_dim=None, out_bias=True, qk_norm="rms_norm_across_heads")
    return attn, transformer_ltx.LTXVideoAttnProcessor()


def _qwenimage():
    from diffusers.models.attention_processor import Attention
    from diffusers.models.transformers import transformer_qwenimage

    processor = transformer_qwenimage.QwenDoubleStreamAttnProcessor2_0()
    attn = Attention(query_dim=3072, cross_attention_dim=None, added_kv_proj_dim=3072, dim_head=128, heads=24,
                     out_dim=3072, context_pre_only=False, bias=True, processor=processor, qk_norm="rms_norm", eps=1e-6)
    return attn, processor


def _cogvideox():
    from diffusers.models.attention_processor import Attention, CogVideoXAttnProcessor2_0

    processor = CogVideoXAttnProcessor2_0()
    attn = Attention(query_dim=3072, dim_head=64, heads=48, qk_norm="layer_norm", eps=1e-6, bias=True, out_bias=True,
                     processor=processor)
    return attn, processor


def _complex(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Qwen-Image's table form: ``[S, D / 2]`` complex ``cos + i sin`` (one angle a pair)."""
    return torch.complex(cos[:, 0::2], sin[:, 1::2])


#: Shapes of the families not in the attention benchmark's list: (video tokens, head dim). HunyuanVideo at 544 x 960,
#: 129 frames (33 x 68 x 120 latents, 1 x 2 x 2 patches); LTX-Video at 768 x 512, 121 frames (16 x 16 x 24 latents);
#: Qwen-Image at 1024 x 1024 (128 x 128 latents, 2 x 2 patches); CogVideoX-5B at 720 x 480, 49 frames (13 x 60 x 90
#: latents, 2 x 2 patches).
EXTRA_SHAPES = {"hunyuanvideo_544p": (67320, 128), "ltx_768x512": (6144, 64), "qwenimage_1024": (4096, 128),
                "cogvideox_720x480": (17550, 64)}

FAMILIES = {
    "wan": Family("diffusers.models.transformers.transformer_wan", _wan, 5120, "rotary_emb", "pair",
                  lambda cos, sin, s: (cos[None, :, None, :], sin[None, :, None, :])),
    "flux": Family("diffusers.models.transformers.transformer_flux", _flux, 3072, "image_rotary_emb", "element",
                   lambda cos, sin, s: (cos, sin)),
    "hunyuanvideo": Family("diffusers.models.transformers.transformer_hunyuan_video", _hunyuanvideo, 3072,
                           "image_rotary_emb", "element", lambda cos, sin, s: (cos[:s], sin[:s]), text_tokens=256),
    "ltx": Family("diffusers.models.transformers.transformer_ltx", _ltx, 2048, "image_rotary_emb", "element",
                  lambda cos, sin, s: (cos.repeat(1, 32)[None], sin.repeat(1, 32)[None])),  # [1, S, heads * head dim]
    "qwenimage": Family("diffusers.models.transformers.transformer_qwenimage", _qwenimage, 3072, "image_rotary_emb",
                        "complex", lambda cos, sin, s: (_complex(cos[:s], sin[:s]), _complex(cos[s:], sin[s:])),
                        text_tokens=256),
    "cogvideox": Family("diffusers.models.attention_processor", _cogvideox, 3072, "image_rotary_emb", "element",
                        lambda cos, sin, s: (cos[:s], sin[:s]), text_tokens=226, sdpa=True),
}


def measure(shape_name: str, device: torch.device, iters: int) -> dict:
    import importlib

    family = FAMILIES[shape_name.split("_")[0]]
    module = importlib.import_module(family.module)
    tokens, head_dim = (EXTRA_SHAPES[shape_name] if shape_name in EXTRA_SHAPES
                        else (SHAPES[shape_name].tokens, SHAPES[shape_name].head_dim))
    attn, processor = family.build()
    attn = attn.to(device, torch.bfloat16).eval()
    ours_entry = DEFERRED[f"{type(processor).__module__}.{type(processor).__qualname__}"]
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(1, tokens, family.width, device=device, dtype=torch.bfloat16, generator=g)
    text = {}
    if family.text_tokens:
        text["encoder_hidden_states"] = torch.randn(1, family.text_tokens, family.width, device=device,
                                                    dtype=torch.bfloat16, generator=g)
    angle = torch.rand(tokens + family.text_tokens, head_dim // 2, device=device, generator=g) * 100
    tables = family.tables(angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1), tokens)
    seen: dict[str, torch.Tensor] = {}

    def record(query, key, value, *args, **kwargs):  # the attention call, replaced: Q and K as rotated, [B, S, H, D]
        seen["q"], seen["k"] = (query.transpose(1, 2), key.transpose(1, 2)) if family.sdpa else (query, key)
        return query.clone()

    def run(rotary):
        return processor(attn, hidden, **text, **{family.argument: rotary})

    def ours():
        return ours_entry.rotate(q, k, tables)

    name, replacement = (("F", types.SimpleNamespace(**{**vars(torch.nn.functional),
                                                         "scaled_dot_product_attention": record}))
                         if family.sdpa else ("dispatch_attention_fn", record))
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        with torch.no_grad():
            run(None)
            q, k = seen["q"], seen["k"]
            run(tables)
            stock_q, stock_k = seen["q"], seen["k"]
            with_rope = time_fn(lambda: run(tables), device, iters=iters).median_ms
            without = time_fn(lambda: run(None), device, iters=iters).median_ms
            ours_q, ours_k = ours()
            ours_ms = time_fn(ours, device, iters=iters).median_ms
    finally:
        setattr(module, name, original)
    return {
        "shape": shape_name, "tokens": tokens, "heads": q.shape[2], "head_dim": head_dim, "rule": family.rule,
        "stock_processor_ms": with_rope, "stock_processor_without_rotary_ms": without,
        "stock_rotary_ms": with_rope - without, "ours_ms": ours_ms, "fused": _fused(ours),
        "bit_equal": bool(torch.equal(ours_q, stock_q) and torch.equal(ours_k, stock_k)),
    }


def _fused(rotate: Callable[[], Any]) -> bool:
    """Whether ``rotate()`` ran the one-launch kernel (rather than its torch form)."""
    from diffusers_trtllm.kernels import rotary

    launches, launch = [], rotary._launch
    rotary._launch = lambda *args: launches.append(1) or launch(*args)
    try:
        rotate()
    finally:
        rotary._launch = launch
    return bool(launches)


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"GPU {env.get('gpu')}, torch {env['torch']}, Triton {env.get('triton')}, Diffusers {env.get('diffusers')}; "
             f"`{result['command']}`", "",
             "One self-attention call (bf16, batch 1; Wan2.1-14B's for `wan_*`, a Flux.1-dev single-stream block's "
             "for `flux_*`, a HunyuanVideo single-stream block's with 256 text tokens for `hunyuanvideo_*`, "
             "LTX-Video's for `ltx_*`, Qwen-Image's joint attention with 256 text tokens for `qwenimage_*`, CogVideoX-5B's "
             "with 226 for `cogvideox_*`): Diffusers' "
             "processor with and without its rotary embedding (attention call replaced by a "
             "copy of Q; the difference is the rotation), and our rotation (`serving.rotary`: Q and K in one launch) "
             "on the same Q and K. `bit-equal`: our Q and K equal the stock processor's.", "",
             "| shape | tokens | stock processor (ms) | without rotary (ms) | stock rotation (ms) | ours (ms) | "
             "saved a call (ms) | bit-equal |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['shape']} | {r['tokens']} | {r['stock_processor_ms']:.2f} | {r['stock_processor_without_rotary_ms']:.2f} "
              f"| {r['stock_rotary_ms']:.2f} | {r['ours_ms']:.3f} | {r['stock_rotary_ms'] - r['ours_ms']:.2f} "
              f"| {'yes' if r['bit_equal'] else '**no**'} |" for r in result["rows"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    per_shape_main(__doc__, "benchmarks/bench_rotary.py", "wan_14b_480p,wan_14b_720p,flux_1024", "rotary.json", 10,
                   measure, markdown)


if __name__ == "__main__":
    main()
