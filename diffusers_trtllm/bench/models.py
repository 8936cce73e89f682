"""Full-size Diffusers transformers from their published configs, with random weights, and their inputs.

The configs are the ``transformer/config.json`` of the Hugging Face repositories
(embedded: nothing is downloaded). A model is built directly on the target device
and cast the way ``from_pretrained(torch_dtype=...)`` casts it (modules named in
``_keep_in_fp32_modules`` stay fp32). ``tiny`` shrinks widths and depth for CPU
tests; ``probe`` keeps the attention geometry (head dim, RoPE, token grid) and
drops depth and width, for the CPU calibration of the structured weights.

Random weights give flat attention, where skip-softmax skips nothing.
``local_attention`` makes self-attention local: every Q/K projection of a
self/joint attention module gets one large shared bias, so after QK-norm all
tokens' queries and keys point the same way and RoPE alone sets the score,
``sum_pairs a_p cos(omega_p * distance)``: highest at distance 0 and falling
with distance (see the function for the knob).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ..integration.roles import guess_role

__all__ = ["ModelSpec", "MODELS", "build_model", "model_inputs", "local_attention", "make_attention_local",
           "normalized_to_model_timestep"]


@dataclass(frozen=True)
class ModelSpec:
    """A published transformer and the input geometry it is timed at."""

    name: str
    #: Diffusers class name (``diffusers.<class_name>``).
    class_name: str
    family: str  # "wan" or "flux": how inputs are built
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

    def describe(self, variant: str = "full") -> str:
        tiny = variant == "tiny"
        latent = self.tiny_latent if tiny else self.latent
        overrides = {"tiny": self.tiny_config, "probe": self.probe_config}.get(variant, {})
        changed = f" ({variant}: {', '.join(f'{k}={v}' for k, v in overrides.items())})" if overrides else ""
        text = self.tiny_text_tokens if tiny else self.text_tokens
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

MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec(
            "wan2.1-t2v-14b", "WanTransformer3DModel", "wan",
            {**_WAN_21, "ffn_dim": 13824, "num_attention_heads": 40, "num_layers": 40},
            _WAN_480P, 512, _WAN_TINY, (16, 2, 4, 8), 8, _WAN_PROBE, contrast=32.0,
        ),
        ModelSpec(
            "wan2.1-t2v-1.3b", "WanTransformer3DModel", "wan",
            {**_WAN_21, "ffn_dim": 8960, "num_attention_heads": 12, "num_layers": 30},
            _WAN_480P, 512, _WAN_TINY, (16, 2, 4, 8), 8, _WAN_PROBE, contrast=32.0,
        ),
        ModelSpec(
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
    return t if spec.family == "flux" else t * 1000.0  # Flux's pipeline divides by 1000; Wan passes raw steps


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
    text = spec.tiny_text_tokens if tiny else spec.text_tokens
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
    raise ValueError(f"no input builder for family {spec.family!r}.")


#: RMS of the shared Q/K bias per element; the token-dependent part W x has RMS about 0.6
#: (default Linear init on unit-RMS activations), so after QK-norm it is ~7% of each vector.
SHARED_BIAS_RMS = 8.0
_QK_PROJECTIONS = ("to_q", "to_k", "add_q_proj", "add_k_proj")
_QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


@torch.no_grad()
def make_attention_local(
    model: torch.nn.Module, contrast: float, *, seed: int = 0, spread: float = 0.0
) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Make self/joint attention of ``model`` local, in place.

    Returns the number of attention modules changed and ``(parameter, original value)`` pairs.

    Every self/joint attention module gets one random shared vector ``s`` as the bias of
    all its Q and K projections, and QK-norm weights ``g = sqrt(contrast / sqrt(head_dim))``,
    so two tokens at RoPE distance 0 score about ``contrast`` nats (``g**2 * sqrt(head_dim)``),
    and the part of the score that varies with distance (RoPE's faster frequencies) is a
    fraction of that. Larger ``contrast``: sharper attention, more tiles skipped at a
    threshold (``python -m diffusers_trtllm.bench e2e --probe`` measures it). ``spread`` scales
    ``s`` per head from ``1 - spread`` to ``1 + spread``, so heads differ in reach (a smoother
    sparsity-versus-threshold curve). Cross-attention (text keys, no RoPE) is left alone.
    """
    if contrast <= 0:
        raise ValueError(f"contrast must be > 0 nats; got {contrast!r}.")
    if not 0.0 <= spread < 1.0:
        raise ValueError(f"spread must be in [0, 1); got {spread!r}.")
    gen = torch.Generator().manual_seed(seed)
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    changed = 0
    for name, module in model.named_modules():
        if not (hasattr(module, "to_q") and hasattr(module, "to_k") and hasattr(module, "heads")):
            continue
        if guess_role(name, module) == "cross":
            continue
        inner = module.to_q.out_features
        head_dim = inner // module.heads
        norms = [getattr(module, n) for n in _QK_NORMS if getattr(module, n, None) is not None]
        if not norms or any(getattr(n, "weight", None) is None for n in norms):
            raise ValueError(
                f"{name} ({type(module).__name__}) has no QK-norm weights: local_attention sets the score's "
                "scale through them. Use a family with QK-norm (Wan, Flux) or the random weights."
            )
        shared = torch.randn(inner, generator=gen) * SHARED_BIAS_RMS
        if spread:
            shared *= torch.linspace(1.0 - spread, 1.0 + spread, module.heads).repeat_interleave(head_dim)
        gain = math.sqrt(contrast / math.sqrt(head_dim))
        for proj in (getattr(module, p, None) for p in _QK_PROJECTIONS):
            if proj is None:
                continue
            if proj.bias is None or proj.out_features != inner:
                raise ValueError(f"{name}: a Q/K projection without a bias of size {inner}; cannot add the shared bias.")
            saved.append((proj.bias, proj.bias.detach().clone()))
            proj.bias.copy_(shared)
        for norm in norms:
            saved.append((norm.weight, norm.weight.detach().clone()))
            norm.weight.fill_(gain)
        changed += 1
    if not changed:
        raise ValueError(f"{type(model).__name__} has no self/joint attention module with to_q/to_k projections.")
    return changed, saved


@contextlib.contextmanager
def local_attention(model: torch.nn.Module, contrast: float, *, seed: int = 0) -> Iterator[int]:
    """Inside the block, ``make_attention_local(model, contrast)`` holds; the weights are restored after.

    Yields the number of attention modules changed.
    """
    changed, saved = make_attention_local(model, contrast, seed=seed)
    try:
        yield changed
    finally:
        for param, value in saved:
            param.data.copy_(value)
