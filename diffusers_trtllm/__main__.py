"""Example generation: dense vs skip-softmax vs skip-softmax + SAGE, side by side.

``python -m diffusers_trtllm`` (or ``python examples/generate.py``) with no arguments
builds a small Flux pipeline from configs (random weights, no download; the text
encoders are replaced by ``prompt_embeds``), runs it on the CPU three times
(dense; skip-softmax; skip-softmax + int8 SAGE, the last two on the ``reference``
route), saves ``outputs/comparison.png`` and prints per-step tables and the
differences. ``--model ID`` runs that real pipeline on a GPU with the chosen settings.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
from diffusers.callbacks import PipelineCallback

from . import SkipSoftmaxConfig, TrtllmAttnProcessor, attach_denoise_tracking, load_calibration
from .bench.timing import cosine, rel_l1

_DEMO_PROMPT_TOKENS = 8


def build_demo_pipeline(seed: int = 0):
    """A Flux pipeline small enough for a 2-core CPU, with sharpened attention so tiles get skipped.

    Random weights give flat attention (nothing to skip); the QK-norm gains are raised so
    scores have the peaks a trained model's attention has.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=32,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[8, 12, 12],
    ).eval()
    for module in transformer.modules():
        for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            norm = getattr(module, name, None)
            if getattr(norm, "weight", None) is not None:
                norm.weight.data.fill_(5.0)
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
        "prompt_embeds": torch.randn(1, _DEMO_PROMPT_TOKENS, 32, generator=g),
        "pooled_prompt_embeds": torch.randn(1, 32, generator=g),
        "height": 64,
        "width": 64,
    }
    return pipe, inputs


def _transformers(pipe: Any) -> list[torch.nn.Module]:
    return [m for m in (getattr(pipe, "transformer", None), getattr(pipe, "transformer_2", None)) if m is not None]


def install(pipe: Any, proc: TrtllmAttnProcessor) -> None:
    """The processor on every transformer of the pipeline, with per-step timestep tracking."""
    for transformer in _transformers(pipe):
        transformer.set_attn_processor(proc)
    attach_denoise_tracking(pipe, proc)


class _KeepLatents(PipelineCallback):
    """Keeps the final latents (the transformer's work, before the VAE) for the comparison."""

    tensor_inputs = ["latents"]

    def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
        self.latents = callback_kwargs["latents"].detach().float().cpu()
        return callback_kwargs


def generate(pipe: Any, proc: TrtllmAttnProcessor, inputs: dict, steps: int, seed: int, label: str):
    """One pipeline run with ``proc``: (first image, final latents, seconds)."""
    install(pipe, proc)
    proc.reset_stats()
    device = getattr(pipe, "_execution_device", torch.device("cpu"))
    generator = torch.Generator(device).manual_seed(seed)
    keep = _KeepLatents()
    pipe.set_progress_bar_config(desc=f"{label:<16}", leave=True)
    start = time.perf_counter()
    out = pipe(**inputs, num_inference_steps=steps, generator=generator, output_type="pil", callback_on_step_end=keep)
    return _first_image(out), keep.latents, time.perf_counter() - start


def _first_image(out: Any):
    import numpy as np
    from PIL import Image

    if hasattr(out, "images"):
        image = out.images[0]
    else:  # video pipelines: the middle frame
        frames = out.frames[0]
        image = frames[len(frames) // 2]
    if isinstance(image, Image.Image):
        return image
    array = np.asarray(image, dtype=np.float32)
    return Image.fromarray((array.clip(0, 1) * 255).round().astype("uint8"))


def save_side_by_side(panels: list[tuple[str, Any]], path: str, min_size: int = 256) -> str:
    """Images with their labels above, in one row, saved as PNG."""
    from PIL import Image, ImageDraw

    scale = max(1, min_size // max(img.height for _, img in panels))
    tiles = [(label, img.resize((img.width * scale, img.height * scale), Image.NEAREST)) for label, img in panels]
    pad, head = 8, 22
    width = sum(img.width for _, img in tiles) + pad * (len(tiles) + 1)
    height = max(img.height for _, img in tiles) + head + 2 * pad
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    x = pad
    for label, img in tiles:
        draw.text((x, pad), label, fill="black")
        canvas.paste(img.convert("RGB"), (x, pad + head))
        x += img.width + pad
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    canvas.save(path)
    return path


def _difference(latents: torch.Tensor, dense: torch.Tensor) -> str:
    return f"final latents rel-L1 {rel_l1(latents, dense):.2e}, cosine {cosine(latents, dense):.6f}"


def _processor(args: argparse.Namespace, skip: bool, sage: bool, backend: str) -> TrtllmAttnProcessor:
    quant = {"dtype_qk": args.quant} if sage and args.quant != "none" else None
    return TrtllmAttnProcessor(
        skip_softmax_threshold=args.threshold if skip and args.target_sparsity is None else None,
        target_sparsity=args.target_sparsity if skip else None,
        disabled_until_timestep=args.disabled_until_timestep if skip else 0.0,
        quant=quant,
        backend=backend,
        fallback=args.fallback,
        collect_stats=args.collect_stats or backend == "reference",
    )


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    """Offline CPU demo on a tiny random Flux pipeline; returns the images and tables."""
    pipe, inputs = build_demo_pipeline(args.seed)
    backend = args.backend if args.backend != "auto" else "reference"
    runs = [
        ("dense", _processor(args, skip=False, sage=False, backend="auto")),
        ("skip-softmax", _processor(args, skip=True, sage=False, backend=backend)),
        (f"skip + SAGE {args.quant}", _processor(args, skip=True, sage=True, backend=backend)),
    ]
    results: dict[str, Any] = {}
    for label, proc in runs:
        image, latents, seconds = generate(pipe, proc, inputs, args.steps, args.seed, label)
        results[label] = {"image": image, "latents": latents, "seconds": seconds, "table": proc.step_table(),
                          "text": proc.format_step_table(), "processor": repr(proc)}
    dense = results["dense"]["latents"]
    print(f"\nTiny Flux pipeline (random weights, {pipe.transformer.config.num_attention_heads} heads), "
          f"{args.steps} steps on the CPU")
    for label, res in results.items():
        print(f"\n== {label} ({res['seconds']:.2f} s): {res['processor']} ==\n{res['text']}")
        if label != "dense":
            res["difference"] = _difference(res["latents"], dense)
            print(f"difference vs dense: {res['difference']}")
    path = save_side_by_side([(label, res["image"]) for label, res in results.items()], os.path.join(args.out, "comparison.png"))
    print(f"\nsaved {path}")
    results["path"] = path
    return results


def run_model(args: argparse.Namespace) -> None:
    """A real pipeline on a GPU: the chosen settings (and a dense run with --compare)."""
    from diffusers import DiffusionPipeline

    if not torch.cuda.is_available():
        sys.exit("--model needs a CUDA GPU (the CPU demo runs without --model).")
    pipe = DiffusionPipeline.from_pretrained(args.model, torch_dtype=torch.bfloat16).to("cuda")
    inputs: dict[str, Any] = {"prompt": args.prompt}
    if args.height:
        inputs["height"] = args.height
    if args.width:
        inputs["width"] = args.width
    proc = _processor(args, skip=True, sage=True, backend=args.backend)
    runs = ([("dense", _processor(args, skip=False, sage=False, backend="auto"))] if args.compare else []) + [("trtllm", proc)]
    panels = []
    for label, p in runs:
        install(pipe, p)
        if label == "trtllm" and (args.target_sparsity is not None or args.calibration):
            print("calibration:", load_calibration(pipe, args.calibration))
        image, latents, seconds = generate(pipe, p, inputs, args.steps, args.seed, label)
        print(f"\n== {label}: {seconds:.1f} s ==\n{p.format_step_table()}")
        panels.append((label, image, latents))
    if args.compare:
        print(f"difference vs dense: {_difference(panels[1][2], panels[0][2])}")
    panels = [(label, image) for label, image, _ in panels]
    path = save_side_by_side(panels, os.path.join(args.out, "generate.png"), min_size=0)
    print(f"saved {path}")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows defaults and keeps the module docstring's line breaks."""


def _checked(convert: Any, check: Any) -> Any:
    """An argparse ``type``: ``convert`` the text, then ``check`` it with the library's own validation."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if convert is int else 'a number'}; got {text!r}") from None
        try:
            check(value)
        except (TypeError, ValueError) as err:
            raise argparse.ArgumentTypeError(str(err).split("; got")[0] + f"; got {text!r}") from None
        return value

    parse.__name__ = convert.__name__  # argparse names the type in its messages
    return parse


def _positive(value: int) -> None:
    if value < 1:
        raise ValueError("must be >= 1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from .routes import route_names

    p = argparse.ArgumentParser(prog="python -m diffusers_trtllm", description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument("--model", help="Hugging Face model id or path (GPU); omit for the offline CPU demo")
    p.add_argument("--prompt", default="A cat holding a sign that says hello world", help="with --model")
    p.add_argument("--steps", type=_checked(int, _positive), default=None,
                   help="denoising steps (None: 8 for the demo, 28 with --model)")
    p.add_argument("--threshold", type=_checked(float, lambda v: SkipSoftmaxConfig(threshold=v)), default=0.2,
                   help="skip_softmax_threshold (lambda), in [0, 1)")
    p.add_argument("--target-sparsity", type=_checked(float, lambda v: SkipSoftmaxConfig(target_sparsity=v)),
                   default=None, help="in [0, 1], instead of --threshold; needs a calibration")
    p.add_argument("--calibration", default=None,
                   help="sparse_attention_config JSON file or model directory (None: the model's own config)")
    p.add_argument("--disabled-until-timestep", default=0.7,
                   type=_checked(float, lambda v: SkipSoftmaxConfig(disabled_until_timestep=v)),
                   help="normalized timestep in [0, 1]: dense while t is above this")
    p.add_argument("--quant", choices=["int8", "fp8_e4m3", "none"], default="int8", help="SAGE dtype for Q/K")
    p.add_argument("--backend", choices=["auto", *route_names()], default="auto",
                   help="route name or auto (demo: auto means reference)")
    p.add_argument("--fallback", choices=["dense"], default=None, help="run dense what no route can honour")
    p.add_argument("--height", type=_checked(int, _positive), default=None, help="with --model (None: the pipeline's)")
    p.add_argument("--width", type=_checked(int, _positive), default=None, help="with --model (None: the pipeline's)")
    p.add_argument("--seed", type=_checked(int, lambda v: None), default=0, help="random seed")
    p.add_argument("--compare", action="store_true", help="with --model: also run dense and save both")
    p.add_argument("--collect-stats", action="store_true", help="ask GPU routes for skipped-tile counts")
    p.add_argument("--out", default="outputs", help="output directory")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 28 if args.model else 8
    if args.calibration is not None and not os.path.exists(args.calibration):
        p.error(f"argument --calibration: {args.calibration!r} does not exist")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model:
        run_model(args)
    else:
        run_demo(args)


if __name__ == "__main__":
    main()
