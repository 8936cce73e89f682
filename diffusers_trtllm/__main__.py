"""Example generation and calibration from the command line.

``python -m diffusers_trtllm`` with no arguments runs the offline demo: a tiny Flux pipeline
built from configs (random weights, no download, ``prompt_embeds`` instead of text
encoders) whose attention is made local so skip-softmax has tiles to skip, run on the CPU
three times (dense; skip-softmax; skip-softmax + SAGE, the last two on the ``reference``
route). It saves ``outputs/comparison.png`` (images, difference maps, rel-L1 and skipped
fraction) and ``outputs/sparsity.png`` (skipped fraction per layer and step), and prints
per-step tables. Its wall times are the CPU running reference code, not a measure of speed.
``--model ID`` runs a real pipeline on a GPU with the chosen settings.

``python -m diffusers_trtllm calibrate --model ID --prompts FILE --out calib.json`` measures
where skip-softmax would skip and writes a ModelOpt ``sparse_attention_config``; without
``--model`` it calibrates the tiny offline pipeline.

``python -m diffusers_trtllm card --prompts FILE --out DIR [--model ID] [--push-to-hub REPO]`` writes a setting's
model card (docs/model_card.md): the setting, its speed and its quality against dense.

``python -m diffusers_trtllm build-kernels`` compiles every variant of the project's CUDA kernel
into the cache (``$DIFFUSERS_TRTLLM_CACHE``), for a Docker image or an offline machine; no GPU needed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from typing import Any, Callable, NoReturn

# Only what answers --help and checks the arguments is imported here: torch and Diffusers load once the
# arguments are known to be good (``python -m diffusers_trtllm --help`` answers in well under 2 s).
from .config import CPU_ROUTES, GROUP_BY, POLICIES, ROUTE_NAMES, SkipSoftmaxConfig, check_fit_range
from .demo import DEMO_MAX_SIZE, DEMO_SIZE
from .machine import cuda_device_count

PROG = "python -m diffusers_trtllm"
#: Defaults the README quotes; ``--help`` shows them.
DEFAULT_THRESHOLD = 0.2  # the offline demo's: its tiny model's hand-made local attention
MODEL_THRESHOLD = 0.05  # with --model: the full-size benchmarks' (docs/usage.md, "Which threshold")
DEFAULT_GATE = 0.9
DEFAULT_PROMPT = "A cat holding a sign that says hello world"
#: What the demo's timings are, printed with them.
TIMING_NOTE = ("wall times are the CPU running the reference route (a PyTorch oracle of the GPU kernels): "
               "they say nothing of speed; the GPU kernels' speed is in docs/performance.md")


def _difference(latents: Any, dense: Any) -> str:
    from .measure import cosine, rel_l1

    return f"final latents rel-L1 {rel_l1(latents, dense):.2e}, cosine {cosine(latents, dense):.6f}"


def _processor(args: argparse.Namespace, skip: bool, sage: bool, backend: str) -> Any:
    from .serving.processor import TrtllmAttnProcessor

    quant = {"dtype_qk": args.quant} if sage and args.quant != "none" else None
    return TrtllmAttnProcessor(
        skip_softmax_threshold=args.threshold if skip and args.target_sparsity is None else None,
        target_sparsity=args.target_sparsity if skip else None,
        disabled_until_timestep=args.disabled_until_timestep if skip else None,
        quant=quant,
        backend=backend,
        fallback=args.fallback,
        policy=args.policy,
        collect_stats=args.collect_stats or backend == "reference",
    )


def _skipped(table: list[dict]) -> float | None:
    """Skipped tiles over all tiles of the steps that ran sparse."""
    rows = [r for r in table if r["mode"] == "sparse" and r["skipped_fraction"] is not None]
    return sum(r["skipped_fraction"] * r["sparse_calls"] for r in rows) / sum(r["sparse_calls"] for r in rows) if rows else None


def _demo_calibration(pipe: Any, inputs: dict, args: argparse.Namespace) -> Any:
    """``--calibration`` if given; otherwise calibrate the tiny pipeline now (it takes a second)."""
    from .calibration import calibrate

    if args.calibration:
        return args.calibration
    print("--target-sparsity without --calibration: calibrating the tiny pipeline first "
          "(python -m diffusers_trtllm calibrate writes one to a file).")
    embeds = {k: inputs[k] for k in ("prompt_embeds", "pooled_prompt_embeds")}
    cal = calibrate(pipe, [embeds], steps=args.steps, height=inputs["height"], width=inputs["width"],
                    fit_range=(0.05, 0.95), disabled_until_timestep=args.disabled_until_timestep)
    print(cal.format())
    return cal.config()


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    """Offline CPU demo on a tiny random Flux pipeline with local attention; returns images and tables."""
    from .measure import rel_l1
    from .calibration import load_calibration
    from .demo import build_demo_pipeline, comparison_image, generate, image_rel_l1, install, latent_difference
    from .stats import format_summary

    pipe, inputs = build_demo_pipeline(args.seed)
    inputs.update(height=args.height or DEMO_SIZE, width=args.width or DEMO_SIZE)
    backend = args.backend if args.backend != "auto" else "reference"
    calibration = _demo_calibration(pipe, inputs, args) if args.target_sparsity is not None else None
    sage = args.quant if args.quant != "none" else None
    runs = [
        ("dense", _processor(args, skip=False, sage=False, backend="auto")),
        ("skip-softmax", _processor(args, skip=True, sage=False, backend=backend)),
        (f"skip + SAGE {sage}" if sage else "skip (no SAGE)", _processor(args, skip=True, sage=True, backend=backend)),
    ]
    results: dict[str, Any] = {}
    for label, proc in runs:
        if calibration is not None and label != "dense":
            install(pipe, proc)
            load_calibration(pipe, calibration)
        image, latents, seconds = generate(pipe, proc, inputs, args.steps, args.seed, label)
        results[label] = {"image": image, "latents": latents, "seconds": seconds, "table": proc.step_table(),
                          "text": proc.format_step_table(), "processor": repr(proc), "proc": proc}
    dense = results["dense"]
    tokens = (inputs["height"] // 2) * (inputs["width"] // 2)
    print(f"\nTiny Flux pipeline: RANDOM WEIGHTS, attention made local (shared Q/K bias + RoPE), "
          f"{tokens} image tokens, {args.steps} steps on the CPU")
    skip_how = (f"target_sparsity={args.target_sparsity}" if args.target_sparsity is not None
                else f"skip_softmax_threshold={args.threshold}")
    panels = []
    for label, res in results.items():
        print(f"\n== {label} ({res['seconds']:.2f} s of CPU wall time): {res['processor']} ==\n{res['text']}")
        lines = [f"route {','.join(sorted({r['routes'] for r in res['table']}))}"]
        if label != "dense":
            res["difference"] = _difference(res["latents"], dense["latents"])
            res["image_rel_l1"] = image_rel_l1(res["image"], dense["image"])
            res["skipped"] = _skipped(res["table"])
            print(f"difference vs dense: {res['difference']}; image rel-L1 {res['image_rel_l1']:.4f}")
            skipped = "n/a" if res["skipped"] is None else f"{res['skipped']:.0%}"
            lines += [f"skipped {skipped} of tiles (sparse steps)",
                      f"rel-L1 vs dense: image {res['image_rel_l1']:.4f}",
                      f"  latents {rel_l1(res['latents'], dense['latents']):.4f}"]
        difference = None if label == "dense" else latent_difference(res["latents"], dense["latents"], inputs["height"], inputs["width"])
        panels.append({"label": label, "image": res["image"], "lines": lines, "difference": difference})
    last = results[runs[-1][0]]["proc"]
    print(f"\nskipped fraction per layer and step ({runs[-1][0]}):\n{format_summary(last.layers)}")
    title = (f"diffusers-trtllm offline demo - tiny Flux pipeline with RANDOM WEIGHTS (the images are noise)\n"
             f"attention made local so tiles can be skipped; {skip_how}, "
             f"disabled_until_timestep={args.disabled_until_timestep}, {args.steps} steps, CPU")
    path = comparison_image(panels, os.path.join(args.out, "comparison.png"), title)
    print(f"\nNote: the {TIMING_NOTE}.")
    print(f"\nsaved {path}")
    results["path"] = path
    try:
        results["plot"] = last.plot(os.path.join(args.out, "sparsity.png"), title=f"skipped-tile fraction, {runs[-1][0]}")
        print(f"saved {results['plot']}")
    except ImportError as err:
        print(f"(no heatmap: {err})")
    return results


def run_model(args: argparse.Namespace) -> None:
    """A real pipeline on a GPU: the chosen settings (and a dense run with --compare)."""
    import torch
    from diffusers import DiffusionPipeline

    from .calibration import load_calibration
    from .demo import comparison_image, generate, image_rel_l1, install

    if not torch.cuda.is_available():
        raise RuntimeError("--model needs a CUDA GPU (the CPU demo runs without --model).")
    pipe = DiffusionPipeline.from_pretrained(args.model, torch_dtype=torch.bfloat16).to("cuda")
    inputs: dict[str, Any] = {"prompt": args.prompt or DEFAULT_PROMPT}
    if args.height:
        inputs["height"] = args.height
    if args.width:
        inputs["width"] = args.width
    proc = _processor(args, skip=True, sage=True, backend=args.backend)
    runs = ([("dense", _processor(args, skip=False, sage=False, backend="auto"))] if args.compare else []) + [("trtllm", proc)]
    panels, latents_of = [], {}
    for label, p in runs:
        install(pipe, p)
        if label == "trtllm" and (args.target_sparsity is not None or args.calibration):
            print("calibration:", load_calibration(pipe, args.calibration))
        image, latents, seconds = generate(pipe, p, inputs, args.steps, args.seed, label)
        print(f"\n== {label}: {seconds:.1f} s ==\n{p.format_step_table()}")
        latents_of[label] = latents
        lines = [f"{seconds:.1f} s"]
        if label == "trtllm" and args.compare:
            lines.append(f"rel-L1 vs dense: image {image_rel_l1(image, panels[0]['image']):.4f}")
            print(f"difference vs dense: {_difference(latents, latents_of['dense'])}")
        panels.append({"label": label, "image": image, "lines": lines})
    path = comparison_image(panels, os.path.join(args.out, "generate.png"), f"{args.model}: {inputs['prompt']}", min_size=0)
    print(f"saved {path}")
    print(f"saved {proc.plot(os.path.join(args.out, 'sparsity.png'))}" if _has_matplotlib() else "")


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows defaults and keeps the module docstring's line breaks."""


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: what was wrong and what to do, exit status 2, no usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def _checked(convert: Callable[[str], Any], check: Callable[[Any], Any]) -> Callable[[str], Any]:
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


def _given(argv: list[str], flag: str) -> bool:
    """Whether ``flag`` is on the command line (the parsers take no abbreviations)."""
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _writable_directory(path: str) -> str | None:
    """Why nothing can be written into directory ``path``, or None: a file is written and removed in it, or in
    the nearest folder above it that exists (the only check that holds whoever runs it). Nothing is made, so a
    run that fails leaves no empty folder behind; the results' writers make the missing ones."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing!r} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return err.strerror or str(err)
    return None


def _read_prompts(p: argparse.ArgumentParser, path: str) -> list[str]:
    """The prompts of ``path``, one per non-empty line; a file that is not UTF-8 text or holds no prompt is an
    argument error naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip()]
    except UnicodeDecodeError as err:
        p.error(f"argument --prompts: {path!r} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                f"{err.start}); save it as UTF-8, one prompt per line")
    except OSError as err:
        p.error(f"argument --prompts: cannot read {path!r}: {err.strerror or err}")
    if not prompts:
        p.error(f"argument --prompts: {path!r} holds no prompt; write one prompt per line")
    return prompts


def _library_check(p: argparse.ArgumentParser, flag: str, check: Callable[[Any], Any], value: Any) -> None:
    """``check(value)``, the library's own validation; what it refuses becomes an argument error."""
    try:
        check(value)
    except ValueError as err:
        p.error(f"argument {flag}: {err}")


def _check_offline_size(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("height", "width"):
        value = getattr(args, name)
        if value is not None and (value % 16 or value > DEMO_MAX_SIZE):
            p.error(f"argument --{name}: the offline pipeline takes a multiple of 16 up to {DEMO_MAX_SIZE} (CPU time "
                    f"grows with the square of the token count); got {value}")


def _check_gpu(p: argparse.ArgumentParser) -> None:
    """``--model`` runs on a CUDA GPU: refused in the argument check where the driver shows none."""
    if not cuda_device_count():
        p.error("argument --model: run on a machine with a CUDA GPU, or drop --model for the offline CPU demo: "
                "this machine has none")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=_checked(int, lambda v: None), default=0, help="random seed")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error, not just its line")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The demo's arguments, every value checked before any model is built (an error exits with status 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = _Parser(prog=PROG, description=__doc__, formatter_class=_HelpFormatter, allow_abbrev=False)
    p.add_argument("--model", help="Hugging Face model id or path (GPU); omit for the offline CPU demo")
    p.add_argument("--prompt", default=None,
                   help=f"with --model (None: {DEFAULT_PROMPT!r}); the offline demo has no text encoder")
    p.add_argument("--steps", type=_checked(int, _positive), default=None,
                   help="denoising steps (None: 8 for the demo, 28 with --model)")
    p.add_argument("--threshold", type=_checked(float, lambda v: SkipSoftmaxConfig(threshold=v)),
                   default=DEFAULT_THRESHOLD,
                   help=f"skip_softmax_threshold (lambda), in [0, 1); not with --target-sparsity. The default is the "
                        f"offline toy's; with --model it is {MODEL_THRESHOLD}")
    p.add_argument("--target-sparsity", type=_checked(float, lambda v: SkipSoftmaxConfig(target_sparsity=v)),
                   default=None, help="in [0, 1], instead of --threshold; uses --calibration (offline without one: "
                                      "the tiny pipeline is calibrated first)")
    p.add_argument("--calibration", default=None,
                   help="sparse_attention_config JSON file or model directory, for --target-sparsity "
                        "(None: the model's own config; offline: calibrate first)")
    p.add_argument("--disabled-until-timestep", default=DEFAULT_GATE,
                   type=_checked(float, lambda v: SkipSoftmaxConfig(disabled_until_timestep=v)),
                   help="normalized timestep in [0, 1]: dense while t is above this")
    p.add_argument("--quant", choices=["int8", "fp8_e4m3", "none"], default="int8", help="SAGE dtype for Q/K")
    p.add_argument("--backend", choices=["auto", *ROUTE_NAMES], default="auto",
                   help=f"route name or auto (offline demo, on the CPU: {' or '.join(CPU_ROUTES)}; auto means reference)")
    p.add_argument("--fallback", choices=["dense"], default=None, help="run dense what no route can honour")
    p.add_argument("--policy", choices=list(POLICIES), default="auto",
                   help="auto: run dense where skip/SAGE measured slower (on H100/H200: skip alone without a "
                        "target_sparsity >= 0.35, SAGE on short sequences); always: run what was asked")
    p.add_argument("--height", type=_checked(int, _positive), default=None,
                   help=f"None: the pipeline's (offline: a multiple of 16 up to {DEMO_MAX_SIZE}, None: {DEMO_SIZE})")
    p.add_argument("--width", type=_checked(int, _positive), default=None,
                   help=f"None: the pipeline's (offline: a multiple of 16 up to {DEMO_MAX_SIZE}, None: {DEMO_SIZE})")
    p.add_argument("--compare", action="store_true", help="with --model: also run dense and save both (the demo always does)")
    p.add_argument("--collect-stats", action="store_true", help="ask GPU routes for skipped-tile counts")
    p.add_argument("--out", default="outputs", help="output directory")
    _add_common(p)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 28 if args.model else 8
    if args.model and not _given(argv, "--threshold"):
        args.threshold = MODEL_THRESHOLD
    if args.target_sparsity is not None and _given(argv, "--threshold"):
        p.error("arguments --threshold and --target-sparsity are exclusive (a threshold, or a sparsity the "
                "calibration turns into one); pass one of them")
    if args.calibration is not None:
        if args.target_sparsity is None:
            p.error("argument --calibration is read for --target-sparsity; pass --target-sparsity too (or drop "
                    "--calibration and use --threshold)")
        if not os.path.exists(args.calibration):
            p.error(f"argument --calibration: {args.calibration!r} does not exist")
        from .calibration.checkpoint import check_calibration  # reads the file: the library's own validation

        _library_check(p, "--calibration", check_calibration, args.calibration)
    if not args.model:
        if args.prompt is not None:
            p.error("argument --prompt needs --model: the offline demo has no text encoder (it uses random prompt "
                    "embeddings)")
        _check_offline_size(p, args)
        if args.backend not in ("auto", *CPU_ROUTES):
            p.error(f"argument --backend: {args.backend!r} runs on a CUDA GPU, and the offline demo runs on the CPU; "
                    f"pass --backend {' or '.join(CPU_ROUTES)} (auto: reference), or --model on a GPU")
        if args.backend == "sdpa" and args.fallback is None:  # the demo's second and third runs ask for skip-softmax
            p.error("argument --backend: 'sdpa' runs dense attention only, and the demo's skip-softmax (+ SAGE) runs "
                    "need a route that skips tiles; pass --backend reference (or auto), or add --fallback dense to "
                    "run them dense on sdpa")
    why = _writable_directory(args.out)
    if why:
        p.error(f"argument --out: cannot write the images to {args.out!r}: {why}; pass a writable directory")
    if args.model:
        _check_gpu(p)  # last: every value is checked on a machine without a GPU too
    return args


def parse_calibrate_args(argv: list[str]) -> argparse.Namespace:
    """The ``calibrate`` command's arguments, every value checked before any model is built."""
    p = _Parser(
        prog=f"{PROG} calibrate", formatter_class=_HelpFormatter, allow_abbrev=False,
        description="Measure per layer and step where skip-softmax would skip (one dense run per prompt) and write "
                    "ModelOpt's sparse_attention_config (factor = a * exp(b * target_sparsity)) for --target-sparsity "
                    "and load_calibration. Without --model: the tiny offline pipeline, on random prompt embeddings.")
    p.add_argument("--model", help="Hugging Face model id or path (GPU); omit for the tiny offline pipeline")
    p.add_argument("--prompts", help="text file, one prompt per line (needs --model)")
    p.add_argument("--num-prompts", type=_checked(int, _positive), default=2, help="offline: how many random prompt embeddings")
    p.add_argument("--out", default="calibration.json",
                   help="a .json file to write, or a checkpoint folder (save_pretrained's) whose config.json takes it")
    p.add_argument("--steps", type=_checked(int, _positive), default=None,
                   help="denoising steps per prompt (None: 8 offline, 28 with --model)")
    p.add_argument("--height", type=_checked(int, _positive), default=None,
                   help=f"None: the pipeline's (offline: a multiple of 16 up to {DEMO_MAX_SIZE}, None: {DEMO_SIZE})")
    p.add_argument("--width", type=_checked(int, _positive), default=None,
                   help=f"None: the pipeline's (offline: a multiple of 16 up to {DEMO_MAX_SIZE}, None: {DEMO_SIZE})")
    p.add_argument("--group-by", choices=GROUP_BY, default="transformer", help="one curve per transformer, role or layer")
    p.add_argument("--target-sparsity", type=_checked(float, lambda v: SkipSoftmaxConfig(target_sparsity=v)), default=None,
                   help="recommended operating point written with the curve")
    p.add_argument("--disabled-until-timestep", type=_checked(float, lambda v: SkipSoftmaxConfig(disabled_until_timestep=v)),
                   default=0.0,
                   help="leave steps with t above this out of the fit, and write it with the curve")
    p.add_argument("--fit-range", type=_checked(float, lambda v: None), nargs=2, default=(0.05, 0.95), metavar=("LOW", "HIGH"), help="sparsities the curve is fitted over")
    p.add_argument("--tile", type=_checked(int, _positive), nargs=2, default=(128, 128), metavar=("Q", "KV"),
                   help="the kernel's tile")
    _add_common(p)
    args = p.parse_args(argv)
    if args.model and not args.prompts:
        p.error("argument --model needs --prompts FILE (one prompt per line)")
    if args.prompts and not args.model:
        p.error("argument --prompts needs --model: the offline pipeline has no text encoder (it uses --num-prompts "
                "random prompt embeddings)")
    if args.prompts and not os.path.isfile(args.prompts):
        p.error(f"argument --prompts: {args.prompts!r} is not a file")
    args.prompt_lines = _read_prompts(p, args.prompts) if args.prompts else None
    _library_check(p, "--fit-range", check_fit_range, args.fit_range)
    if not args.model:
        _check_offline_size(p, args)
    if os.path.isdir(args.out):
        if not any(os.path.isfile(os.path.join(args.out, n)) for n in ("config.json", "model_index.json")):
            p.error(f"argument --out: {args.out!r} is a folder but no checkpoint (no config.json or model_index.json); "
                    "pass a .json file path or a folder saved with save_pretrained")
    why = _writable_directory(args.out if os.path.isdir(args.out) else os.path.dirname(os.path.abspath(args.out)))
    if why:
        p.error(f"argument --out: cannot write the calibration to {args.out!r}: {why}; pass a writable path")
    if args.model:
        _check_gpu(p)  # last: every value is checked on a machine without a GPU too
    if args.steps is None:
        args.steps = 28 if args.model else 8
    return args


def run_calibrate(args: argparse.Namespace) -> Any:
    """Calibrate a model (GPU) or the tiny offline pipeline, and write the JSON."""
    import torch

    from .calibration import save_calibration
    from .calibration import calibrate
    from .demo import build_demo_pipeline

    kwargs: dict[str, Any] = {k: getattr(args, k) for k in ("height", "width") if getattr(args, k)}
    if args.model:
        from diffusers import DiffusionPipeline

        if not torch.cuda.is_available():
            raise RuntimeError("calibrate --model needs a CUDA GPU (without --model it calibrates the tiny offline "
                               "pipeline).")
        prompts: list[Any] = args.prompt_lines
        pipe = DiffusionPipeline.from_pretrained(args.model, torch_dtype=torch.bfloat16).to("cuda")
    else:
        pipe, inputs = build_demo_pipeline(args.seed)
        kwargs = {"height": args.height or DEMO_SIZE, "width": args.width or DEMO_SIZE}
        g = torch.Generator().manual_seed(args.seed + 100)
        prompts = [{k: torch.randn(v.shape, generator=g) for k, v in inputs.items() if k.endswith("prompt_embeds")}
                   for _ in range(args.num_prompts)]
    cal = calibrate(pipe, prompts, steps=args.steps, group_by=args.group_by, fit_range=tuple(args.fit_range),
                    target_sparsity=args.target_sparsity, disabled_until_timestep=args.disabled_until_timestep,
                    tile=tuple(args.tile), seed=args.seed, **kwargs)
    print(cal.format())
    print(f"saved {save_calibration(cal, args.out)}")
    return cal


def parse_build_args(argv: list[str]) -> argparse.Namespace:
    """The ``build-kernels`` command's arguments."""
    p = _Parser(
        prog=f"{PROG} build-kernels", formatter_class=_HelpFormatter, allow_abbrev=False,
        description="Compile every variant of the sage-sm90 CUDA kernel (head dim, output dtype, K block, skip) into "
                    "the cubin cache, so that no attention call waits for a build: for a Docker image or an offline "
                    "machine. Uses NVRTC (torch's CUDA wheels install it) or the nvcc that DIFFUSERS_TRTLLM_NVCC names; "
                    "needs no GPU. The cache is $DIFFUSERS_TRTLLM_CACHE/cubin (default ~/.cache/diffusers_trtllm/cubin).")
    p.add_argument("--cache", default=None, help="cache folder to fill (sets DIFFUSERS_TRTLLM_CACHE for this run)")
    p.add_argument("--jobs", type=_checked(int, _positive), default=None, help="builds at once (None: one per core)")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error, not just its line")
    args = p.parse_args(argv)
    if args.cache:
        why = _writable_directory(args.cache)
        if why:
            p.error(f"argument --cache: cannot write to {args.cache!r}: {why}; pass a writable folder")
    return args


def run_build_kernels(args: argparse.Namespace) -> list[str]:
    """Fill the cubin cache with every sage-sm90 variant; prints where they are."""
    if args.cache:
        os.environ["DIFFUSERS_TRTLLM_CACHE"] = os.path.abspath(args.cache)
    from .kernels import cuda_jit
    from .kernels.sage_sm90 import VARIANTS, build_kernels

    cubins = build_kernels(VARIANTS, jobs=args.jobs)
    print(f"{len(cubins)} sage-sm90 kernels in {cuda_jit.cache_dir()} (built by {cuda_jit.find_compiler().version}); "
          "the Triton quantizer beside them compiles on the GPU at first use, in seconds.")
    return [str(c) for c in cubins]


def parse_card_args(argv: list[str]) -> argparse.Namespace:
    """The ``card`` command's arguments, every value checked before any model is built."""
    from .card import METRICS_EXTRA, TINY_MODEL_ID

    p = _Parser(
        prog=f"{PROG} card", formatter_class=_HelpFormatter, allow_abbrev=False,
        description="Calibrate a pipeline (or take --calibration), run it dense and with the setting on the same "
                    "prompts and seeds, and write a folder for the Hugging Face Hub: the setting "
                    "(trtllm_attention.json), a README.md model card with the speed, the quality against dense per "
                    "prompt (PSNR, SSIM; LPIPS where the lpips package is installed), the skipped fraction per layer "
                    "and step, and side-by-side images. docs/model_card.md is the guide.")
    p.add_argument("--model", default=TINY_MODEL_ID,
                   help=f"Hugging Face model id or path (GPU); {TINY_MODEL_ID!r} is the demo's tiny offline pipeline "
                        "(random weights, CPU)")
    p.add_argument("--prompts", required=True, help="text file, one prompt per line")
    p.add_argument("--target-sparsity", type=_checked(float, lambda v: SkipSoftmaxConfig(target_sparsity=v)),
                   default=0.5, help="the setting's target_sparsity, in [0, 1]")
    p.add_argument("--disabled-until-timestep", default=DEFAULT_GATE,
                   type=_checked(float, lambda v: SkipSoftmaxConfig(disabled_until_timestep=v)),
                   help="normalized timestep in [0, 1]: dense while t is above this")
    p.add_argument("--quant", choices=["int8", "fp8_e4m3", "none"], default="none", help="SAGE dtype for Q/K")
    p.add_argument("--calibration", default=None,
                   help="a sparse_attention_config JSON file, model folder, saved setting or Hub repo id (None: "
                        "calibrate on the prompts first)")
    p.add_argument("--seeds", type=_checked(int, _positive), default=2, help="seeds per prompt (0, 1, ...)")
    p.add_argument("--steps", type=_checked(int, _positive), default=None,
                   help="denoising steps (None: 4 for the tiny pipeline, 28 with --model)")
    p.add_argument("--license", default="apache-2.0", help="the card's license (the setting's; a Hub license id)")
    p.add_argument("--out", required=True, help="folder to write the card into")
    p.add_argument("--push-to-hub", default=None, metavar="REPO", help="upload the folder to this Hub repo (user/name)")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error, not just its line")
    args = p.parse_args(argv)
    args.offline = args.model == TINY_MODEL_ID
    if args.steps is None:
        args.steps = 4 if args.offline else 28
    if not os.path.isfile(args.prompts):
        p.error(f"argument --prompts: {args.prompts!r} is not a file")
    args.prompt_lines = _read_prompts(p, args.prompts)
    missing = [m for m in ("torchmetrics", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        p.error(f"the card measures with {' and '.join(missing)}, which is not installed; "
                f"pip install 'diffusers-trtllm[{METRICS_EXTRA}]'")
    if args.calibration is not None and os.path.exists(args.calibration):
        from .calibration.checkpoint import check_calibration

        _library_check(p, "--calibration", check_calibration, args.calibration)
    if args.push_to_hub is not None:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(args.push_to_hub)
        except HFValidationError as err:
            p.error(f"argument --push-to-hub: {str(err).splitlines()[0]}")
    why = _writable_directory(args.out)
    if why:
        p.error(f"argument --out: cannot write the card to {args.out!r}: {why}; pass a writable folder")
    return args


def run_card(args: argparse.Namespace) -> str:
    """Calibrate (or read --calibration), run dense and with the setting, and write the card folder."""
    import torch
    from tqdm.auto import tqdm

    from .calibration import calibrate, load_calibration
    from .card import make_card, prompt_inputs
    from .demo import build_demo_pipeline
    from .serving import install
    from .serving.processor import TrtllmAttnProcessor

    if args.offline:
        pipe, demo_inputs = build_demo_pipeline(0)
        inputs = prompt_inputs(args.prompt_lines, demo_inputs)
        backend, calibration_prompts = "reference", [{k: v for k, v in i.items() if k.endswith("embeds")} for i in inputs]
        size = {"height": demo_inputs["height"], "width": demo_inputs["width"]}
    else:
        from diffusers import DiffusionPipeline

        if not torch.cuda.is_available():
            raise RuntimeError("card --model needs a CUDA GPU (without --model it makes the tiny offline pipeline's card "
                               "on the CPU).")
        pipe = DiffusionPipeline.from_pretrained(args.model, torch_dtype=torch.bfloat16).to("cuda")
        inputs, backend, calibration_prompts, size = prompt_inputs(args.prompt_lines, None), "auto", args.prompt_lines, {}
    pipe.set_progress_bar_config(disable=True)
    proc = TrtllmAttnProcessor(target_sparsity=args.target_sparsity, disabled_until_timestep=args.disabled_until_timestep,
                               quant=None if args.quant == "none" else {"dtype_qk": args.quant}, backend=backend,
                               collect_stats=args.offline)
    if args.calibration is None:
        calibration = calibrate(pipe, calibration_prompts, steps=args.steps, fit_range=(0.05, 0.95),
                                target_sparsity=args.target_sparsity,
                                disabled_until_timestep=args.disabled_until_timestep, **size)
        note = f"the {len(args.prompt_lines)} prompt(s) below, {args.steps} steps (`calibrate`)"
    else:
        calibration, note = args.calibration, f"`{args.calibration}`"
    install(pipe, proc)
    load_calibration(pipe, calibration)
    readme = make_card(pipe, proc, args.prompt_lines, inputs, args.out, model_id=args.model, steps=args.steps,
                       seeds=args.seeds, calibration_note=note, repo_id=args.push_to_hub, license=args.license,
                       offline=args.offline, progress=lambda work: tqdm(work, desc="card: dense and setting runs"))
    print(f"saved {readme}")
    if args.push_to_hub:
        proc.save_pretrained(args.out, push_to_hub=True, repo_id=args.push_to_hub)
        print(f"uploaded {args.out} to https://huggingface.co/{args.push_to_hub}")
    return readme


#: Subcommands, by first argument: (argument parser, runner).
COMMANDS: dict[str, tuple[Callable[[list[str]], argparse.Namespace], Callable[[argparse.Namespace], Any]]] = {
    "calibrate": (parse_calibrate_args, run_calibrate),
    "build-kernels": (parse_build_args, run_build_kernels),
    "card": (parse_card_args, run_card),
}


def main(argv: list[str] | None = None) -> None:
    """``python -m diffusers_trtllm`` and the ``diffusers-trtllm`` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = COMMANDS[command][0](argv[1:]) if command else parse_args(argv)
    try:
        if command:
            COMMANDS[command][1](args)
        elif args.model:
            run_model(args)
        else:
            run_demo(args)
    except Exception as err:  # one line for the user; --debug shows where it came from
        if args.debug:
            raise
        text = str(getattr(err, "brief", None) or err).strip()  # NoRouteError's one-line form keeps its reasons
        line = text.splitlines()[0] if text else type(err).__name__
        sys.exit(f"{PROG}{' ' + command if command else ''}: error: {line} (--debug shows the traceback)")


if __name__ == "__main__":
    main()
