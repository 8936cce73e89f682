"""Context-parallel benchmark: one transformer forward over several GPUs (Diffusers' Ulysses or ring),
stock against ours.

One process per GPU, launched by torchrun (every rank builds the same seeded model and inputs)::

    torchrun --nproc-per-node 2 -m diffusers_trtllm.bench cp --model wan2.1-t2v-14b --latent 16,21,90,160

``--ring R`` splits the GPUs as ring degree R times Ulysses degree N/R (``--ring 2`` on two GPUs:
ring alone). Under ring, stock runs Diffusers' cuDNN backend (``_native_cudnn``: its default
``native`` returns no log-sum-exp), so stock ring needs CUDA.

With ``--nproc-per-node 1`` the same forward runs on one GPU without parallelism (the single-GPU
figures to compare against). Per setting (``stock`` first: Diffusers' own context-parallel
attention, cuDNN SDPA): the output forward, then the median time; speed is stock's time over
the setting's, rel-L1 against the stock output. Rank 0 writes ``NAME.json``. Statistics are
rank 0's (its heads). See docs/design.md, "Context parallelism".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..locality import local_attention
from ..measure import rel_l1
from .cli import add_common_args, names
from .e2e import DEFAULT_THRESHOLD, SETTINGS, stock_sdpa_context, processor_summary
from .models import MODELS, build_model, model_inputs
from .report import environment, format_cp_markdown
from .timing import time_fn

__all__ = ["run_cp", "main"]

#: Wan 2.1 at 720p, 81 frames: 21 x 90 x 160 latents, 75,600 tokens after 1x2x2 patches.
WAN_720P = (16, 21, 90, 160)

#: The e2e settings this bench runs: every one but those calibrated on the e2e bench's own stock forward.
CP_SETTINGS = {name: s for name, s in SETTINGS.items() if s.target_sparsity is None}


def _init_distributed(device: str) -> torch.device:
    """The process group from torchrun's environment; this rank's device."""
    cuda = torch.device(device).type == "cuda"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    if torch.accelerator.device_count() == 0:
        # Diffusers computes rank % torch.accelerator.device_count() when it builds the mesh.
        torch.accelerator.device_count = lambda: 1
    return torch.device("cpu")


def run_cp(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting of ``args.configs`` on this rank; the rows (identical on every rank but timings)."""
    from diffusers import ContextParallelConfig

    from .. import TrtllmAttnProcessor, install, uninstall

    device = _init_distributed(args.device)
    world = dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    spec = MODELS[args.model]
    model = build_model(spec, device=device, dtype=dtype, seed=args.seed, variant=args.variant)
    inputs = model_inputs(spec, model, t=args.t, device=device, dtype=dtype, seed=args.seed,
                          tiny=args.variant == "tiny", latent=args.latent)
    if world % args.ring:
        raise ValueError(f"--ring {args.ring} does not divide the {world} processes; pass a divisor of the GPU count.")
    ulysses = world // args.ring
    if args.ring > 1:  # Diffusers' default backend (native SDPA) refuses ring's return_lse
        model.set_attention_backend("_native_cudnn")
    if world > 1:
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ulysses, ring_degree=args.ring))

    def forward() -> torch.Tensor:
        with torch.no_grad(), stock_sdpa_context(args.stock_sdpa, device):
            return model(**inputs)[0]

    rows: list[dict[str, Any]] = []
    structured = local_attention(model, args.contrast or spec.contrast, seed=args.seed) \
        if args.weights == "structured" else contextlib.nullcontext()
    with structured:
        reference = None
        for name in ("stock", *[c for c in args.configs if c != "stock"]):
            setting = SETTINGS[name]
            proc = None
            if not setting.stock:
                proc = TrtllmAttnProcessor(**setting.processor_kwargs(args.threshold, args.backend),
                                           collect_stats=setting.skip)
                install(model, proc)
                proc.set_timestep(args.t)
            out = forward()
            summary = processor_summary(proc) if proc is not None else None
            if proc is not None:
                proc.collect_stats = False  # timed without the counting
            dist.barrier()
            timing = time_fn(forward, device, warmup=args.warmup, iters=args.iters, max_seconds=3600.0)
            reference = out if reference is None else reference
            rows.append({
                "setting": name, "time_ms": timing.median_ms, "iters": timing.iters,
                "speed_vs_stock": rows[0]["time_ms"] / timing.median_ms if rows else 1.0,
                "rel_l1_vs_stock": rel_l1(out, reference),
                "routes": summary.routes if summary else {}, "policy": summary.policy if summary else {},
                "skipped_fraction_rank0": summary.skipped_route if summary else None,
            })
            if proc is not None:
                uninstall(model)
    return {"model": f"{type(model).__name__} ({args.model}, {args.variant})", "latent": list(inputs["hidden_states"].shape[1:]),
            "tokens": _tokens(model, inputs), "ulysses_degree": ulysses, "ring_degree": args.ring,
            "weights": args.weights,
            "threshold": args.threshold, "t": args.t, "rows": rows}


def _tokens(model: torch.nn.Module, inputs: dict[str, Any]) -> int:
    """Image/video tokens of the forward (after patching)."""
    hidden = inputs["hidden_states"]
    if hidden.ndim == 5:  # Wan: [B, C, F, H, W], patches of config.patch_size
        return int(torch.Size(n // p for n, p in zip(hidden.shape[2:], model.config.patch_size)).numel())
    return hidden.shape[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m diffusers_trtllm.bench cp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="wan2.1-t2v-14b", choices=sorted(MODELS))
    p.add_argument("--latent", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help=f"latent shape (Wan: C,F,H,W; 720p: {','.join(map(str, WAN_720P))}); default the model's")
    p.add_argument("--configs", type=names, default=("dense", "sage-int8", "sage-int8+skip"),
                   help=f"comma-separated, from {', '.join(CP_SETTINGS)} (stock always runs first)")
    p.add_argument("--weights", default="structured", choices=["random", "structured"])
    p.add_argument("--contrast", type=float, default=None, help="structured weights' contrast (nats); default the model's")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD)
    p.add_argument("--t", type=float, default=0.5)
    p.add_argument("--backend", default="auto")
    p.add_argument("--ring", type=int, default=1,
                   help="ring degree (divides the process count; the rest is Ulysses); stock then runs cuDNN")
    p.add_argument("--stock-sdpa", default="cudnn", choices=["cudnn", "default"])
    p.add_argument("--variant", default="full", choices=["full", "tiny", "probe"])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    add_common_args(p, "cp", "NAME.json")
    args = p.parse_args(argv)
    calibrated = set(args.configs) & (set(SETTINGS) - set(CP_SETTINGS))
    if calibrated:
        p.error(f"--configs: {sorted(calibrated)} fit their curve to the e2e bench's stock forward, which this bench "
                f"does not run; use the e2e bench for them, or choose from {', '.join(CP_SETTINGS)}")
    unknown = set(args.configs) - set(CP_SETTINGS)
    if unknown:
        p.error(f"--configs: unknown {sorted(unknown)}; choose from {', '.join(CP_SETTINGS)}")
    return args


def main(argv: list[str] | None = None) -> Path | None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    result = run_cp(args)
    path = None
    if dist.get_rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{args.name}.json"
        env = environment(str(torch.device(args.device)), ["cp", *argv])
        env["command"] = f"torchrun --nproc-per-node {dist.get_world_size()} -m diffusers_trtllm.bench " \
                         + " ".join(["cp", *argv])
        data = {"environment": env, **result}
        path.write_text(json.dumps(data, indent=2) + "\n")
        path.with_suffix(".md").write_text(format_cp_markdown(data))
        for row in result["rows"]:
            print(f"{row['setting']:>16}: {row['time_ms']:9.1f} ms  {row['speed_vs_stock']:.3f}x stock  "
                  f"rel-L1 {row['rel_l1_vs_stock']:.4f}  {row['routes']}")
    dist.barrier()
    dist.destroy_process_group()
    return path
