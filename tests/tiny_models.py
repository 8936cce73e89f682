"""Tiny, randomly initialised transformers of every served family, with inputs (no download).

Configurations follow Diffusers' own tests (tests/models/transformers/test_models_transformer_*.py),
shrunk where that keeps every attention kind present. ``build(family)`` returns
``(model, inputs)`` with the model in eval mode.
"""

from __future__ import annotations

from typing import Any

import torch

FAMILIES = (
    "flux", "flux2", "sd3", "sd35", "wan_t2v", "wan_i2v", "qwenimage", "hunyuanvideo", "ltx", "cogvideox",
)


def served_and_stock(family: str, processor: Any) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A tiny ``family`` model, its output with ``processor`` installed, and its stock output before (no grad)."""
    from diffusers_trtllm import install

    model, inputs = build(family)
    with torch.no_grad():
        stock = model(**inputs)[0]
        install(model, processor)
        ours = model(**inputs)[0]
    return model, ours, stock


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_g(seed))


def build(family: str, batch: int = 1, seed: int = 0) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(seed)
    fn = globals()[f"_{family}"]
    model, inputs = fn(batch)
    return model.eval(), inputs


def _flux(b):
    from diffusers import FluxTransformer2DModel

    m = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                               num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                               axes_dims_rope=[4, 4, 8])
    return m, dict(hidden_states=_randn(b, 16, 4), encoder_hidden_states=_randn(b, 8, 32, seed=1),
                   pooled_projections=_randn(b, 32, seed=2), timestep=torch.full((b,), 0.5),
                   img_ids=_randn(16, 3, seed=3), txt_ids=_randn(8, 3, seed=4), return_dict=False)


def _flux2(b):
    from diffusers import Flux2Transformer2DModel

    m = Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                num_attention_heads=2, joint_attention_dim=16, timestep_guidance_channels=256,
                                axes_dims_rope=[4, 4, 4, 4])
    return m, dict(hidden_states=_randn(b, 16, 4), encoder_hidden_states=_randn(b, 8, 16, seed=1),
                   timestep=torch.full((b,), 0.5), guidance=torch.full((b,), 1.0),
                   img_ids=_randn(b, 16, 4, seed=3), txt_ids=_randn(b, 8, 4, seed=4), return_dict=False)


def _sd3(b, dual=()):
    from diffusers import SD3Transformer2DModel

    m = SD3Transformer2DModel(sample_size=8, patch_size=1, in_channels=4, num_layers=2, attention_head_dim=8,
                              num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
                              pooled_projection_dim=64, out_channels=4, pos_embed_max_size=96,
                              dual_attention_layers=dual, qk_norm="rms_norm" if dual else None)
    return m, dict(hidden_states=_randn(b, 4, 8, 8), encoder_hidden_states=_randn(b, 8, 32, seed=1),
                   pooled_projections=_randn(b, 64, seed=2), timestep=torch.full((b,), 500.0), return_dict=False)


def _sd35(b):
    return _sd3(b, dual=(0,))


def _wan(b, i2v=False):
    from diffusers import WanTransformer3DModel

    extra = dict(image_dim=12, added_kv_proj_dim=24) if i2v else {}
    m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                              out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                              qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **extra)
    # Wan's I2V processor takes the last 512 context tokens as text (hard-coded), so I2V needs 512.
    text_len = 512 if i2v else 12
    inputs = dict(hidden_states=_randn(b, 4, 2, 8, 8), timestep=torch.full((b,), 700),
                  encoder_hidden_states=_randn(b, text_len, 16, seed=1), return_dict=False)
    if i2v:
        inputs["encoder_hidden_states_image"] = _randn(b, 5, 12, seed=2)
    return m, inputs


def _wan_t2v(b):
    return _wan(b)


def _wan_i2v(b):
    return _wan(b, i2v=True)


def _qwenimage(b):
    from diffusers import QwenImageTransformer2DModel

    m = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                                    num_attention_heads=4, joint_attention_dim=16, guidance_embeds=False,
                                    axes_dims_rope=(8, 4, 4))
    mask = torch.ones(b, 8, dtype=torch.long)
    return m, dict(hidden_states=_randn(b, 16, 16), encoder_hidden_states=_randn(b, 8, 16, seed=1),
                   encoder_hidden_states_mask=mask, timestep=torch.full((b,), 1.0),
                   img_shapes=[(1, 4, 4)] * b, return_dict=False)


def _hunyuanvideo(b):
    from diffusers import HunyuanVideoTransformer3DModel

    m = HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10,
                                       num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=1,
                                       patch_size_t=1, guidance_embeds=True, text_embed_dim=16,
                                       pooled_projection_dim=8, rope_axes_dim=(2, 4, 4))
    mask = torch.ones(b, 6, dtype=torch.long)
    mask[:, 4:] = 0
    return m, dict(hidden_states=_randn(b, 4, 1, 4, 4), timestep=torch.full((b,), 800),
                   encoder_hidden_states=_randn(b, 6, 16, seed=1), encoder_attention_mask=mask,
                   pooled_projections=_randn(b, 8, seed=2), guidance=torch.full((b,), 3.0), return_dict=False)


def _ltx(b):
    from diffusers import LTXVideoTransformer3DModel

    m = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2,
                                   attention_head_dim=8, cross_attention_dim=16, num_layers=1, caption_channels=16,
                                   qk_norm="rms_norm_across_heads")
    mask = torch.ones(b, 6, dtype=torch.long)
    mask[:, 4:] = 0
    return m, dict(hidden_states=_randn(b, 2 * 4 * 4, 8), encoder_hidden_states=_randn(b, 6, 16, seed=1),
                   timestep=torch.full((b,), 600), encoder_attention_mask=mask, num_frames=2, height=4, width=4,
                   return_dict=False)


def _cogvideox(b):
    from diffusers import CogVideoXTransformer3DModel
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    # With rotary embeddings, as CogVideoX-5B and 1.5 (the pipeline computes them: 3 x 4 x 4 patches of the latent).
    m = CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                                    time_embed_dim=4, text_embed_dim=16, num_layers=1, sample_width=8, sample_height=8,
                                    sample_frames=9, patch_size=2, temporal_compression_ratio=4,
                                    max_text_seq_length=16, use_rotary_positional_embeddings=True)
    rotary = get_3d_rotary_pos_embed(embed_dim=16, crops_coords=((0, 0), (4, 4)), grid_size=(4, 4), temporal_size=3,
                                     device="cpu")
    return m, dict(hidden_states=_randn(b, 3, 4, 8, 8), encoder_hidden_states=_randn(b, 16, 16, seed=1),
                   timestep=torch.full((b,), 400), image_rotary_emb=rotary, return_dict=False)


# ---- pipelines (text encoders replaced by prompt embeddings) ----------------------------------
def flux_pipeline(seed: int = 0):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline

    transformer, _ = build("flux", seed=seed)
    vae = AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
                        latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5035)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe, dict(prompt_embeds=_randn(1, 8, 32, seed=5), pooled_prompt_embeds=_randn(1, 32, seed=6),
                      height=8, width=8, output_type="latent")


def wan_pipeline(seed: int = 0, two_experts: bool = False):
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])

    def expert():
        return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                     in_channels=16, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32,
                                     num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                     rope_max_seq_len=32).eval()

    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
                       transformer=expert(), transformer_2=expert() if two_experts else None,
                       boundary_ratio=0.5 if two_experts else None)
    pipe.set_progress_bar_config(disable=True)
    return pipe, dict(prompt_embeds=_randn(1, 16, 32, seed=5), guidance_scale=1.0, height=16, width=16,
                      num_frames=5, output_type="latent")


def sd3_pipeline(seed: int = 0):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    transformer, _ = build("sd3", seed=seed)
    vae = AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
                        latent_channels=4, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5035)
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
                                    text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                                    text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe, dict(prompt_embeds=_randn(1, 8, 32, seed=5), pooled_prompt_embeds=_randn(1, 64, seed=6),
                      guidance_scale=1.0, height=8, width=8, output_type="latent")


def _flow_pipeline(pipeline_cls, family: str, seed: int, **components):
    """A pipeline of ``family``'s tiny transformer with a flow-matching scheduler and no VAE (latents out)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    transformer, _ = build(family, seed=seed)
    pipe = pipeline_cls(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), vae=None,
                        text_encoder=None, tokenizer=None, **components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def hunyuanvideo_pipeline(seed: int = 0):
    from diffusers import HunyuanVideoPipeline

    pipe = _flow_pipeline(HunyuanVideoPipeline, "hunyuanvideo", seed, text_encoder_2=None, tokenizer_2=None)
    return pipe, dict(prompt_embeds=_randn(1, 6, 16, seed=5), pooled_prompt_embeds=_randn(1, 8, seed=6),
                      prompt_attention_mask=torch.ones(1, 6, dtype=torch.long), height=32, width=32, num_frames=1,
                      output_type="latent")


def qwenimage_pipeline(seed: int = 0):
    from diffusers import QwenImagePipeline

    pipe = _flow_pipeline(QwenImagePipeline, "qwenimage", seed)
    return pipe, dict(prompt_embeds=_randn(1, 8, 16, seed=5), prompt_embeds_mask=torch.ones(1, 8, dtype=torch.long),
                      true_cfg_scale=1.0, height=32, width=32, output_type="latent")


def ltx_pipeline(seed: int = 0):
    from diffusers import LTXPipeline

    pipe = _flow_pipeline(LTXPipeline, "ltx", seed)
    return pipe, dict(prompt_embeds=_randn(1, 6, 16, seed=5), prompt_attention_mask=torch.ones(1, 6, dtype=torch.long),
                      guidance_scale=1.0, height=32, width=32, num_frames=9, output_type="latent")
