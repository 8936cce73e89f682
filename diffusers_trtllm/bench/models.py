"""Full-size Diffusers transformers from their published configs, with random weights, and their inputs.

The configs are the ``transformer/config.json`` of the Hugging Face repositories
(embedded: nothing is downloaded). A model is built directly on the target device
and cast the way ``from_pretrained(torch_dtype=...)`` casts it (modules named in
``_keep_in_fp32_modules`` stay fp32). ``tiny`` shrinks widths and depth for CPU
tests; ``probe`` keeps the attention geometry (head dim, RoPE, token grid) and
drops depth and width, for the CPU calibration of the structured weights.

Random weights give flat attention, where skip-softmax skips nothing;
``diffusers_trtllm.locality.local_attention`` makes self-attention local (the benchmark's
structured weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch


__all__ = ["ModelSpec", "MODELS", "build_model", "model_inputs", "normalized_to_model_timestep"]


@dataclass(frozen=True)
class ModelSpec:
    """A published transformer and the input geometry it is timed at."""

    name: str
    #: Diffusers class name (``diffusers.<class_name>``).
    class_name: str
    family: str  # "wan", "flux", "hunyuanvideo", "ltx", "qwenimage" or "sd3": how inputs are built
    config: dict[str, Any]
    #: Latent of one sample: (channels, frames, height, width) for video, (height, width) for images.
    latent: tuple[int, ...]
    text_tokens: int
    tiny_config: dict[str, Any] = field(default_factory=dict)
    tiny_latent: tuple[int, ...] = ()
    tiny_text_tokens: int = 8
    #: Overrides of the probe: shallow and narrow, same head dim, RoPE and latent.
    probe_config: dict[str, Any] = field(default_factory=dict)
    #: Default ``local_attention`` contrast: about half the self-attention tiles skipped at
    #: threshold 0.05 (``e2e --probe`` on the CPU, benchmarks/README.md).
    contrast: float = 32.0

    def text_tokens_of(self, tiny: bool) -> int:
        """Text tokens of the inputs, full size or ``tiny``."""
        return self.tiny_text_tokens if tiny else self.text_tokens

    def describe(self, variant: str = "full") -> str:
        tiny = variant == "tiny"
        latent = self.tiny_latent if tiny else self.latent
        overrides = {"tiny": self.tiny_config, "probe": self.probe_config}.get(variant, {})
        changed = f" ({variant}: {', '.join(f'{k}={v}' for k, v in overrides.items())})" if overrides else ""
        text = self.text_tokens_of(tiny)
        return f"{self.class_name}{changed}, latent {'x'.join(map(str, latent))}, {text} text tokens"


_WAN_21 = {
    "added_kv_proj_dim": None,
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "freq_dim": 256,
    "image_dim": None,
    "in_channels": 16,
    "out_channels": 16,
    "patch_size": [1, 2, 2],
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 1024,
    "text_dim": 4096,
}
_WAN_TINY = {"num_attention_heads": 2, "attention_head_dim": 12, "ffn_dim": 32, "num_layers": 2, "text_dim": 16,
             "rope_max_seq_len": 32}
_WAN_PROBE = {"num_attention_heads": 2, "num_layers": 1, "ffn_dim": 64}
#: 480p, 81 frames: VAE strides 4x8x8 give 21 x 60 x 104 latents; patches 1x2x2 give 32,760 tokens.
_WAN_480P = (16, 21, 60, 104)
#: 720p (1280 x 720), 81 frames: 21 x 90 x 160 latents, 75,600 tokens.
_WAN_720P = (16, 21, 90, 160)
_WAN_14B = {**_WAN_21, "ffn_dim": 13824, "num_attention_heads": 40, "num_layers": 40}

#: HunyuanVideo's transformer (hunyuanvideo-community/HunyuanVideo): 20 double-stream and 40 single-stream blocks.
_HUNYUANVIDEO = {
    "attention_head_dim": 128, "guidance_embeds": True, "in_channels": 16, "mlp_ratio": 4.0, "num_attention_heads": 24,
    "num_layers": 20, "num_refiner_layers": 2, "num_single_layers": 40, "out_channels": 16, "patch_size": 2,
    "patch_size_t": 1, "pooled_projection_dim": 768, "qk_norm": "rms_norm", "rope_axes_dim": [16, 56, 56],
    "rope_theta": 256.0, "text_embed_dim": 4096,
}
#: 544 x 960, 129 frames: VAE strides 4x8x8 give 33 x 68 x 120 latents; patches 1x2x2 give 67,320 tokens.
_HUNYUANVIDEO_544P = (16, 33, 68, 120)

#: LTX-Video's transformer (Lightricks/LTX-Video, 2B): 28 blocks of 32 heads of 64, self- and cross-attention.
_LTX = {
    "activation_fn": "gelu-approximate", "attention_bias": True, "attention_head_dim": 64, "attention_out_bias": True,
    "caption_channels": 4096, "cross_attention_dim": 2048, "in_channels": 128, "norm_elementwise_affine": False,
    "norm_eps": 1e-6, "num_attention_heads": 32, "num_layers": 28, "out_channels": 128, "patch_size": 1,
    "patch_size_t": 1, "qk_norm": "rms_norm_across_heads",
}
#: 768 x 512, 121 frames: VAE strides 8x32x32 give 16 x 16 x 24 latents, 6,144 tokens.
_LTX_768 = (128, 16, 16, 24)

#: Qwen-Image's transformer (Qwen/Qwen-Image, 20B): 60 double-stream blocks of 24 heads of 128.
_QWENIMAGE = {
    "attention_head_dim": 128, "axes_dims_rope": [16, 56, 56], "guidance_embeds": False, "in_channels": 64,
    "joint_attention_dim": 3584, "num_attention_heads": 24, "num_layers": 60, "out_channels": 16, "patch_size": 2,
}

#: SD3.5-Large's transformer (stabilityai/stable-diffusion-3.5-large, 8B): 38 joint blocks of 38 heads of 64, QK
#: norms in Diffusers' RMSNorm, no RoPE (learned positions).
_SD35_LARGE = {
    "attention_head_dim": 64, "caption_projection_dim": 2432, "in_channels": 16, "joint_attention_dim": 4096,
    "num_attention_heads": 38, "num_layers": 38, "out_channels": 16, "patch_size": 2, "pooled_projection_dim": 2048,
    "pos_embed_max_size": 192, "qk_norm": "rms_norm", "sample_size": 128,
}

_FLUX_DEV = ModelSpec(
    "flux.1-dev", "FluxTransformer2DModel", "flux",
    {
        "attention_head_dim": 128,
        "axes_dims_rope": [16, 56, 56],
        "guidance_embeds": True,
        "in_channels": 64,
        "joint_attention_dim": 4096,
        "num_attention_heads": 24,
        "num_layers": 19,
        "num_single_layers": 38,
        "patch_size": 1,
        "pooled_projection_dim": 768,
    },
    # 1024x1024: VAE stride 8 and 2x2 packing give a 64 x 64 token grid.
    (64, 64), 512,
    {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
     "joint_attention_dim": 32, "pooled_projection_dim": 32, "axes_dims_rope": [4, 4, 8], "in_channels": 4},
    (4, 4), 8,
    {"num_layers": 1, "num_single_layers": 0, "num_attention_heads": 2}, contrast=48.0,
)

MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec(
            "wan2.1-t2v-14b", "WanTransformer3DModel", "wan",
            _WAN_14B, _WAN_480P, 512, _WAN_TINY, (16, 2, 4, 8), 8, _WAN_PROBE, contrast=32.0,
        ),
        ModelSpec(
            "wan2.1-t2v-14b-720p", "WanTransformer3DModel", "wan",
            _WAN_14B, _WAN_720P, 512, _WAN_TINY, (16, 2, 4, 8), 8, _WAN_PROBE, contrast=32.0,
        ),
        ModelSpec(
            "wan2.1-t2v-1.3b", "WanTransformer3DModel", "wan",
            {**_WAN_21, "ffn_dim": 8960, "num_attention_heads": 12, "num_layers": 30},
            _WAN_480P, 512, _WAN_TINY, (16, 2, 4, 8), 8, _WAN_PROBE, contrast=32.0,
        ),
        _FLUX_DEV,
        # 1536x1536: a 96 x 96 token grid, 9,728 tokens with the text (between the policy's int8 lengths, issue 57);
        # 2048x2048: a 128 x 128 token grid, 16,896 tokens with the text (issue 57's long image row).
        replace(_FLUX_DEV, name="flux.1-dev-1536", latent=(96, 96)),
        replace(_FLUX_DEV, name="flux.1-dev-2048", latent=(128, 128)),
        ModelSpec(
            "hunyuanvideo-544p", "HunyuanVideoTransformer3DModel", "hunyuanvideo", _HUNYUANVIDEO, _HUNYUANVIDEO_544P,
            256,
            {"num_layers": 1, "num_single_layers": 1, "num_refiner_layers": 1, "num_attention_heads": 2,
             "attention_head_dim": 16, "rope_axes_dim": [4, 6, 6], "text_embed_dim": 32, "pooled_projection_dim": 32,
             "in_channels": 4, "out_channels": 4},
            (4, 2, 4, 8), 8,
            {"num_layers": 1, "num_single_layers": 0, "num_refiner_layers": 1, "num_attention_heads": 2},
        ),
        ModelSpec(
            "ltx-video-768x512", "LTXVideoTransformer3DModel", "ltx", _LTX, _LTX_768, 128,
            {"num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 8, "cross_attention_dim": 16,
             "caption_channels": 16, "in_channels": 8, "out_channels": 8},
            (8, 2, 4, 4), 8,
            # contrast 20: 50.9% of the self-attention tiles skipped at 0.05 (``e2e --probe --device cpu``).
            {"num_layers": 1, "num_attention_heads": 2}, contrast=20.0,
        ),
        ModelSpec(
            # 1024x1024: VAE stride 8 and 2x2 packing give a 64 x 64 token grid.
            "qwen-image", "QwenImageTransformer2DModel", "qwenimage", _QWENIMAGE, (64, 64), 256,
            {"num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 16, "joint_attention_dim": 16,
             "axes_dims_rope": [8, 4, 4], "in_channels": 16, "out_channels": 4},
            (4, 4), 8,
            # contrast 48: 49.0% of the joint attention's tiles skipped at 0.05 (``e2e --probe --device cpu``).
            {"num_layers": 1, "num_attention_heads": 2}, contrast=48.0,
        ),
        ModelSpec(
            # 1024x1024: a 16 x 128 x 128 latent, 2x2 patches: 4,096 image tokens beside 77 CLIP and 256 T5 tokens.
            # No RoPE: structured weights cannot make its attention local (locality.py).
            "sd3.5-large", "SD3Transformer2DModel", "sd3", _SD35_LARGE, (16, 128, 128), 333,
            {"num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 16, "caption_projection_dim": 32,
             "joint_attention_dim": 16, "pooled_projection_dim": 16, "in_channels": 4, "out_channels": 4,
             "sample_size": 8, "pos_embed_max_size": 16},
            (4, 8, 8), 8,
            {"num_layers": 1, "num_attention_heads": 2, "caption_projection_dim": 128},
        ),
    )
}


def _cast_like_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters and buffers to ``dtype``, except those ``_keep_in_fp32_modules`` names."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ()) if dtype != torch.float32 else ()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.float32 if any(m in name for m in keep) else dtype)


def build_model(
    spec: ModelSpec,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int = 0,
    variant: str = "full",
) -> torch.nn.Module:
    """``spec``'s transformer with random weights on ``device`` (``variant``: full, tiny or probe), in eval mode."""
    import diffusers

    overrides = {"full": {}, "tiny": spec.tiny_config, "probe": spec.probe_config}.get(variant)
    if overrides is None:
        raise ValueError(f"variant must be 'full', 'tiny' or 'probe'; got {variant!r}.")
    cls = getattr(diffusers, spec.class_name)
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls.from_config({**spec.config, **overrides})
    _cast_like_from_pretrained(model, dtype)
    return model.eval().requires_grad_(False)


def normalized_to_model_timestep(spec: ModelSpec, t: float) -> float:
    """What the family's pipeline passes as ``timestep`` at normalized time ``t`` (1 = noise)."""
    # Flux's and Qwen-Image's pipelines divide by 1000; Wan's, HunyuanVideo's and LTX-Video's pass raw steps.
    return t if spec.family in ("flux", "qwenimage") else t * 1000.0


def model_inputs(
    spec: ModelSpec,
    model: torch.nn.Module,
    *,
    t: float,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int = 0,
    tiny: bool = False,
    latent: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """Seeded keyword inputs of one forward (batch 1), as the family's pipeline passes them.

    ``latent`` replaces the spec's latent shape (full or ``tiny``).
    """
    cfg = model.config
    latent = latent or (spec.tiny_latent if tiny else spec.latent)
    text = spec.text_tokens_of(tiny)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    timestep = torch.full((1,), normalized_to_model_timestep(spec, t), device=device)
    if spec.family == "wan":
        return dict(hidden_states=randn(1, *latent), timestep=timestep,
                    encoder_hidden_states=randn(1, text, cfg.text_dim), return_dict=False)
    if spec.family == "flux":
        h, w = latent
        rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(h * w, 3).to(dtype)
        inputs = dict(hidden_states=randn(1, h * w, cfg.in_channels),
                      encoder_hidden_states=randn(1, text, cfg.joint_attention_dim),
                      pooled_projections=randn(1, cfg.pooled_projection_dim), timestep=timestep,
                      img_ids=img_ids, txt_ids=torch.zeros(text, 3, device=device, dtype=dtype), return_dict=False)
        if cfg.guidance_embeds:
            inputs["guidance"] = torch.full((1,), 3.5, device=device)
        return inputs
    if spec.family == "hunyuanvideo":  # as HunyuanVideoPipeline passes them: guidance scaled by 1000
        inputs = dict(hidden_states=randn(1, *latent), timestep=timestep,
                      encoder_hidden_states=randn(1, text, cfg.text_embed_dim),
                      encoder_attention_mask=torch.ones(1, text, device=device, dtype=torch.long),
                      pooled_projections=randn(1, cfg.pooled_projection_dim), return_dict=False)
        if cfg.guidance_embeds:
            inputs["guidance"] = torch.full((1,), 6000.0, device=device)
        return inputs
    if spec.family == "ltx":  # as LTXPipeline passes them: tokens packed, the latent grid and RoPE scale beside
        channels, frames, height, width = latent
        return dict(hidden_states=randn(1, frames * height * width, channels), timestep=timestep,
                    encoder_hidden_states=randn(1, text, cfg.caption_channels),
                    encoder_attention_mask=torch.ones(1, text, device=device, dtype=torch.long), num_frames=frames,
                    height=height, width=width, rope_interpolation_scale=(8 / 25, 32, 32), return_dict=False)
    if spec.family == "qwenimage":  # as QwenImagePipeline passes them: packed tokens, the token grid beside
        h, w = latent
        return dict(hidden_states=randn(1, h * w, cfg.in_channels), timestep=timestep,
                    encoder_hidden_states=randn(1, text, cfg.joint_attention_dim),
                    encoder_hidden_states_mask=torch.ones(1, text, device=device, dtype=torch.long),
                    img_shapes=[[(1, h, w)]], return_dict=False)
    if spec.family == "sd3":  # as StableDiffusion3Pipeline passes them: the latent, CLIP and T5 tokens, pooled CLIP
        return dict(hidden_states=randn(1, *latent), timestep=timestep,
                    encoder_hidden_states=randn(1, text, cfg.joint_attention_dim),
                    pooled_projections=randn(1, cfg.pooled_projection_dim), return_dict=False)
    raise ValueError(f"no input builder for family {spec.family!r}.")
