"""Command line of the benchmarks: ``python -m diffusers_trtllm.bench [e2e] ...`` (attention, or end to end)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .cli import add_common_args, floats, names
from .inputs import Shape, load_qkv, parse_shapes
from .report import environment, write_json, write_markdown, write_plot
from .suite import Settings, run_suite


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m diffusers_trtllm.bench", description=__doc__,
                                epilog="The end-to-end benchmark: python -m diffusers_trtllm.bench e2e --help; over GPUs: "
                                       "torchrun --nproc-per-node 2 -m diffusers_trtllm.bench cp --help")
    p.add_argument("--shapes", default="standard", help="'standard', names from inputs.SHAPES, or name=B:S:H:D (comma-separated)")
    p.add_argument("--thresholds", type=floats, default=(), help="skip-softmax thresholds (lambda) to time, e.g. 0.01,0.05")
    p.add_argument("--target-skips", type=floats, default=(0.25, 0.5, 0.75),
                   help="also time the thresholds at which the reference skips these tile fractions ('' for none)")
    p.add_argument("--routes", type=names, default=(),
                   help="only these implementations (route names, torch-cudnn, torch-flash2, flashinfer-fa3, "
                        "flashinfer-fa3-fp8, sageattn, auto); the baseline always runs")
    p.add_argument("--locality", type=float, default=0.5, help="structure of generated inputs in [0, 1] (inputs.py)")
    p.add_argument("--qkv-file", type=Path, help="Q/K/V saved by bench.save_qkv (replaces --shapes)")
    add_common_args(p, "bench", "NAME.json, .md, .png")
    p.add_argument("--ref-heads", type=int, default=4, help="heads the fp32 reference checks (subsample)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--max-seconds", type=float, default=1.0, help="timing budget per item (fewer iterations when slow)")
    p.add_argument("--time-limit", type=float, default=float("inf"), help="stop timing new items after this many seconds")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Path | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["e2e"]:  # the end-to-end benchmark (bench.e2e); the attention benchmark stays the default
        from .e2e import main as e2e_main

        return e2e_main(argv[1:])
    if argv[:1] == ["cp"]:  # context parallelism over GPUs, under torchrun (bench.cp)
        from .cp import main as cp_main

        return cp_main(argv[1:])
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    settings = Settings(
        device=args.device,
        dtype=args.dtype,
        locality=args.locality,
        seed=args.seed,
        thresholds=args.thresholds,
        target_skips=args.target_skips,
        only=args.routes,
        ref_heads=args.ref_heads,
        warmup=args.warmup,
        iters=args.iters,
        max_seconds=args.max_seconds,
        time_limit=args.time_limit,
    )
    qkv = None
    if args.qkv_file:
        q, k, v, meta = load_qkv(args.qkv_file)
        b, s, h, d = q.shape
        shapes = [Shape(str(meta.get("name", args.qkv_file.stem)), b, s, h, d, kv_tokens=k.shape[1])]
        qkv = (q, k, v)
    else:
        shapes = parse_shapes(args.shapes)
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment(args.device, argv)
    stem = args.out / args.name

    def save(results) -> None:  # after every shape, so a stopped run keeps what it measured
        write_json(stem.with_suffix(".json"), env, settings, results)
        write_markdown(stem.with_suffix(".md"), env, settings, results)

    results = run_suite(shapes, settings, qkv=qkv, on_shape_done=save, show_progress=not args.no_progress)
    save(results)
    write_plot(stem.with_suffix(".png"), results)
    return stem.with_suffix(".json")


if __name__ == "__main__":
    main()
