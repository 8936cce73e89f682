"""The offline demo's pieces: a tiny Flux pipeline whose attention is local, runs, and the comparison image.

Random weights give flat attention: every key matters about as much as every other,
so skip-softmax finds nothing to skip. The tiny pipeline here gives Q and K one large
shared component (``locality.make_attention_local``: the same bias on both
projections, before the QK norm); RoPE then rotates it by position, so a score depends
on the distance between two tokens and far-away KV tiles fall below the threshold, as
in a trained model's image attention.
The weights stay random: the images are noise, the attention pattern is not.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: the command line reads this module's sizes before torch loads
    from .serving.processor import TrtllmAttnProcessor

__all__ = ["build_demo_pipeline", "install", "generate", "comparison_image", "output_image", "DEMO_SIZE", "DEMO_MAX_SIZE",
           "DEMO_CONTRAST"]

#: Height and width of the demo's images (1024 image tokens + 8 text tokens).
DEMO_SIZE = 64
#: The largest the demo takes on the CPU (its time grows with the square of the token count).
DEMO_MAX_SIZE = 256
_PROMPT_TOKENS = 8
#: Score of two tokens at distance 0, in nats (``make_attention_local``).
DEMO_CONTRAST = 90.0


def build_demo_pipeline(seed: int = 0, contrast: float = DEMO_CONTRAST, size: int = DEMO_SIZE):
    """A Flux pipeline small enough for a 2-core CPU, with local attention so tiles get skipped.

    ``contrast``: see ``locality.make_attention_local`` (heads spread in reach, so the
    skipped fraction grows smoothly with the threshold). Returns ``(pipe, inputs)``, ``inputs``
    holding random ``prompt_embeds`` (the pipeline has no text encoder).
    """
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    from .locality import make_attention_local

    if size % 16 or size < 16:
        raise ValueError(f"the demo's size must be a multiple of 16 (Flux packs 2x2 latents); got {size}.")
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=32,
        num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[8, 12, 12],
    ).eval()
    make_attention_local(transformer, contrast, seed=seed + 2, spread=0.5)
    vae = AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
        latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.0609, scaling_factor=1.5035,
    )
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
        text_encoder_2=None, tokenizer_2=None, transformer=transformer,
    )
    g = torch.Generator().manual_seed(seed + 1)
    inputs = {
        "prompt_embeds": torch.randn(1, _PROMPT_TOKENS, 32, generator=g),
        "pooled_prompt_embeds": torch.randn(1, 32, generator=g),
        "height": size,
        "width": size,
    }
    return pipe, inputs


def install(pipe: Any, proc: "TrtllmAttnProcessor") -> None:
    """The processor on every transformer of the pipeline, with per-step timestep tracking."""
    from .serving import install as serve
    from .serving.timestep import attach_denoise_tracking

    serve(pipe, proc)
    attach_denoise_tracking(pipe, proc)


def _keep_latents() -> Any:
    """A callback keeping the final latents (the transformer's work, before the VAE) for the comparison."""
    from diffusers.callbacks import PipelineCallback

    class KeepLatents(PipelineCallback):
        tensor_inputs = ["latents"]

        def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
            self.latents = callback_kwargs["latents"].detach().float().cpu()
            return callback_kwargs

    return KeepLatents()


def generate(pipe: Any, proc: "TrtllmAttnProcessor", inputs: dict, steps: int, seed: int, label: str):
    """One pipeline run with ``proc``: (first image, final latents, seconds of wall time)."""
    import torch

    install(pipe, proc)
    proc.reset_stats()
    device = getattr(pipe, "_execution_device", torch.device("cpu"))
    generator = torch.Generator(device).manual_seed(seed)
    keep = _keep_latents()
    pipe.set_progress_bar_config(desc=f"{label:<16}", leave=True)
    start = time.perf_counter()
    out = pipe(**inputs, num_inference_steps=steps, generator=generator, output_type="pil", callback_on_step_end=keep)
    return output_image(out), keep.latents, time.perf_counter() - start


def output_image(out: Any, frame: str = "middle"):
    """A pipeline output's first image, or for a video its ``"middle"`` or ``"first"`` frame, as a PIL image."""
    import numpy as np
    from PIL import Image

    if hasattr(out, "images"):
        image = out.images[0]
    else:
        frames = out.frames[0]
        image = frames[len(frames) // 2 if frame == "middle" else 0]
    if isinstance(image, Image.Image):
        return image
    array = np.asarray(image, dtype=np.float32)
    return Image.fromarray((array.clip(0, 1) * 255).round().astype("uint8"))


def _pixels(image) -> "Any":
    import numpy as np

    return np.asarray(image.convert("RGB"), dtype=np.float32)


def _difference_tiles(panels: list[dict[str, Any]]) -> tuple[list, float, str]:
    """Each panel's difference to the first, all scaled by one factor so the largest shows white.

    Panels may carry ``difference`` (a 2-D array, e.g. of the final latents); otherwise the
    pixels are compared. Returns the images, the factor and what was compared.
    """
    import numpy as np
    from PIL import Image

    given = [p.get("difference") for p in panels[1:]]
    if all(d is not None for d in given):
        diffs, what = [np.asarray(d, dtype=np.float32) for d in given], "final latents"
    else:
        ref = _pixels(panels[0]["image"])
        diffs, what = [np.abs(_pixels(p["image"]) - ref).mean(axis=-1) for p in panels[1:]], "pixels"
    peak = max([float(d.max()) for d in diffs] + [1e-12])
    return [Image.fromarray((d * (255.0 / peak)).clip(0, 255).astype("uint8")).convert("RGB") for d in diffs], peak, what


def latent_difference(latents, reference, height: int, width: int):
    """``|latents - reference|`` of packed Flux latents ``[1, (h/2)*(w/2), C]``, channel mean, as an ``(h/2, w/2)`` map."""
    diff = (latents.float() - reference.float()).abs().mean(dim=-1)[0]
    return diff.reshape(height // 2, width // 2).numpy()


def comparison_image(panels: list[dict[str, Any]], path: str, title: str, min_size: int = 192) -> str:
    """A grid: the images (top row), their differences to the first (bottom row, one common scale), captions.

    ``panels``: dicts with ``label``, ``image``, ``lines`` (caption lines under the label) and
    optionally ``difference`` (a 2-D map to show instead of the pixel difference); the first
    panel is the reference. ``title`` goes above everything.
    """
    from PIL import Image, ImageDraw

    reference = panels[0]["image"]
    diffs, peak, what = _difference_tiles(panels) if len(panels) > 1 else ([], 0.0, "")
    scale = max(1, min_size // max(p["image"].height for p in panels))
    side = reference.width * scale, reference.height * scale
    pad, line = 8, 12
    caption = line * (1 + max(len(p["lines"]) for p in panels))
    width = len(panels) * (side[0] + pad) + pad
    title_lines = title.split("\n")
    top = pad + line * len(title_lines) + pad
    height = top + caption + 2 * side[1] + 2 * line + 3 * pad
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    for i, text in enumerate(title_lines):
        draw.text((pad, pad + i * line), text, fill="black")
    for col, panel in enumerate(panels):
        x = pad + col * (side[0] + pad)
        draw.text((x, top), panel["label"], fill="black")
        for i, text in enumerate(panel["lines"]):
            draw.text((x, top + line * (i + 1)), text, fill=(60, 60, 60))
        y = top + caption + pad
        canvas.paste(panel["image"].convert("RGB").resize(side, Image.NEAREST), (x, y))
        y += side[1] + pad
        if len(panels) == 1:
            continue
        if col == 0:
            draw.text((x, y), f"|difference| to {panel['label']}", fill="black")
            draw.text((x, y + line), f"({what}; white = {peak:.2g}):", fill="black")
        else:
            canvas.paste(diffs[col - 1].resize(side, Image.NEAREST), (x, y + 2 * line))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    canvas.save(path)
    return path


def image_rel_l1(image, reference) -> float:
    """Relative L1 between two images' pixels."""
    import numpy as np
    import torch

    from .measure import rel_l1

    return rel_l1(torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32)),
                  torch.from_numpy(np.asarray(reference.convert("RGB"), dtype=np.float32)))
