"""Benchmark reports: JSON (everything), Markdown (tables), PNG (skip speed-up against the ideal); attention and end to end."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import platform
import shlex
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch

from .suite import Settings, ShapeResult

__all__ = ["environment", "write_json", "write_markdown", "write_plot", "write_e2e_json", "write_e2e_markdown", "format_cp_markdown",
           "per_shape_main"]


def _version(module: str, distribution: str | None = None) -> str | None:
    """Installed version of ``distribution`` (default: the module's name), else the imported module's ``__version__``.

    The distribution's metadata comes first: sageattention has no ``__version__``, and
    FlashInfer's module is ``flashinfer`` but its distribution ``flashinfer-python``.
    """
    try:
        return importlib.metadata.version(distribution or module)
    except importlib.metadata.PackageNotFoundError:
        pass
    if module not in sys.modules and importlib.util.find_spec(module) is None:
        return None
    try:
        return getattr(importlib.import_module(module), "__version__", None)
    except Exception:  # a broken optional install must not stop the report
        return None


def environment(device: str, argv: list[str] | None = None) -> dict[str, Any]:
    """GPU name, driver and library versions, and the command line (``argv``, default the process's) of the results."""
    args = sys.argv[1:] if argv is None else argv
    env: dict[str, Any] = {
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, "-m", "diffusers_trtllm.bench", *args]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "flashinfer": _version("flashinfer", "flashinfer-python"),
        "triton": _version("triton"),
        "sageattention": _version("sageattention"),
        "diffusers": _version("diffusers"),
        "diffusers_trtllm": _version("diffusers_trtllm"),
    }
    if torch.device(device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["sm"] = "".join(map(str, torch.cuda.get_device_capability(device)))
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10,
            ).stdout.strip().splitlines()[0]
        except Exception:
            env["driver"] = None
    else:
        env["gpu"] = None
        env["cpu"] = platform.processor() or platform.machine()
    return env


def _dump(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))


def per_shape_main(doc: str, script: str, shapes: str, out: str, iters: int,
                   measure: Callable[[str, torch.device, int], dict[str, Any]],
                   markdown: Callable[[dict[str, Any]], str]) -> None:
    """The command line of a benchmark script that measures one row per shape on the GPU (``benchmarks/bench_*.py``):
    ``--shapes`` (comma-separated; default ``shapes``), ``--iters``, ``--out``; writes the rows with the environment
    and the command as JSON, its Markdown table beside it (``.md``), and prints the table."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=shapes)
    parser.add_argument("--iters", type=int, default=iters)
    parser.add_argument("--out", type=Path, default=Path(out))
    args = parser.parse_args()
    device = torch.device("cuda")
    result = {"environment": environment(str(device)), "command": f"python3 {script} " + " ".join(sys.argv[1:]),
              "rows": [measure(name, device, args.iters) for name in args.shapes.split(",")]}
    _dump(args.out, result)
    table = markdown(result)
    args.out.with_suffix(".md").write_text(table)
    print(table)


def write_json(path: Path, env: dict[str, Any], settings: Settings, results: list[ShapeResult]) -> None:
    _dump(path, {"environment": env, "settings": asdict(settings), "shapes": [asdict(r) for r in results]})


def write_e2e_json(path: Path, env: dict[str, Any], opts: Any, models: list[Any],
                   rows: list[Any]) -> None:
    """``e2e``'s options, models and rows (dataclasses) as JSON; typed loosely so this module needs no ``e2e``."""
    _dump(path, {"environment": env, "settings": asdict(opts), "models": [asdict(m) for m in models],
                 "rows": [asdict(r) for r in rows]})


def _fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def _header(title: str, env: dict[str, Any]) -> list[str]:
    return [
        f"# {title}",
        "",
        f"GPU: {env.get('gpu') or 'none (CPU)'}, driver {env.get('driver')}, torch {env['torch']}, "
        f"FlashInfer {env['flashinfer']}, Triton {env['triton']}, Diffusers {env.get('diffusers')}, "
        f"SageAttention {env['sageattention']}.",
        f"Command: `{env['command']}`",
        "",
    ]


def write_markdown(path: Path, env: dict[str, Any], settings: Settings, results: list[ShapeResult]) -> None:
    lines = _header("Attention benchmark", env) + [
        f"Inputs: structured generator, locality {settings.locality}, seed {settings.seed}, {settings.dtype}. "
        "Time: median of CUDA-event timings after warm-up. TFLOP/s from 4·B·H·Sq·Skv·D. "
        "`vs cuDNN`: cuDNN SDPA time / this time (same run, same inputs). rel-L1 and cosine against fp32 dense "
        f"attention on a subsample of {settings.ref_heads} heads (all queries). `skipped (ref)`: the skipped-tile "
        "fraction the reference finds on the same inputs and heads at that threshold, with the tiles named per "
        "shape (fmha-v2's bf16 tiles by default) for every route of the row, so a kernel with other tiles "
        "(triton dense 128x128, fmha-v2-fp8 64x256 keys up to head dim 128) skips another fraction there; "
        "`ideal` = 1/(1 - skipped/2); `ref rel-L1`: the reference's own error with that skipping / SAGE emulation.",
        "",
    ]
    for res in results:
        shp = res.shape
        lines += [
            f"## {shp['name']} (B={shp['batch']}, S={shp['tokens']}, H={shp['heads']}, D={shp['head_dim']})",
            "",
            f"Reference heads {res.ref_heads}, tiles {res.ref_tile[0]}x{res.ref_tile[1]}; skipped fraction by "
            "threshold: " + ", ".join(f"{k}: {v:.1%}" for k, v in res.skip_curve.items()),
            "",
            "| impl | config | ms | TFLOP/s | vs cuDNN | rel-L1 | cosine | skipped (ref) | ideal | ref rel-L1 | note |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in res.rows:
            lines.append(
                f"| {r.impl} | {r.config} | {_fmt(r.ms, '.3f')} | {_fmt(r.tflops, '.0f')} | "
                f"{_fmt(r.vs_baseline, '.2f')} | {_fmt(r.rel_l1, '.4f')} | {_fmt(r.cosine, '.5f')} | "
                f"{_fmt(r.skipped_ref, '.1%')} | {_fmt(r.ideal_speedup, '.2f')} | {_fmt(r.ref_rel_l1, '.4f')} | "
                f"{(r.error or '').replace('|', '/')[:120]} |"
            )
        if res.not_run:
            lines += ["", "Not run:", ""]
            lines += [f"- {name}: {why.replace(chr(10), ' ')[:300]}" for name, why in res.not_run.items()]
        lines.append("")
    path.write_text("\n".join(lines))


def write_e2e_markdown(path: Path, env: dict[str, Any], opts: Any, models: list[Any],
                       rows: list[Any]) -> None:
    lines = _header("End-to-end benchmark: one transformer forward", env) + [
        f"Published configs (variants named per model) with random initial weights, batch 1, {opts.dtype}, normalized timestep t={opts.t} (skip-softmax on: "
        "disabled_until_timestep 0). `ms`: median of "
        f"{opts.iters} CUDA-event timings after the output forward and {opts.warmup} warm-up forward(s). "
        "`vs stock`: stock time / this time, stock = Diffusers' own attention"
        f"{' with cuDNN SDPA' if opts.stock_sdpa == 'cudnn' else ''} in the same process on the same inputs and "
        + (f"weights, the median over {opts.alternate} rounds of stock and the setting timed back to back "
           "(`vs_stock_rounds` in the JSON)" if opts.alternate else
           "weights (the faster of its two timings, before and after the settings)")
        + "; compiled rows against stock compiled. `rel-L1`: against the stock output of the same mode. `skipped`: the fraction of self/joint "
        "attention tiles the reference skips at the row's threshold, on Q/K recorded from the stock forward "
        f"({opts.ref_layers} calls x {opts.ref_heads} heads, fmha-v2 tiles); `route skipped`: the routes' own count "
        "over every skip-softmax call, blank when one ran on a route that does not count (fmha-v2). "
        "`routes`: attention role -> routes taken (+skip, +sage: that feature ran); "
        "`note`: what the processor's policy dropped, per role, or the error. "
        "`skip-calibrated`: skip-softmax by `target_sparsity` under the default policy, with a curve "
        "`factor = a * exp(b * s)` fitted to the reference's tiles at the target +- 0.1 (bench.e2e.calibration_for; "
        "its threshold at the target is the row's). "
        "Structured weights: local self-attention (locality.local_attention, contrast per model below).",
        "",
    ]
    for m in models:
        built = f"; built in {m.build_s:.1f} s" if m.build_s is not None else ""
        lines += [f"## {m.model}", "", f"{m.description}{built}; structured contrast {_fmt(m.contrast, 'g')} nats."]
        if m.error:
            lines += ["", f"Not run: {m.error}"]
        for weights, curve in m.skip_curve.items():
            lines.append("")
            lines.append(f"{weights} weights: skip threshold {_fmt(m.threshold.get(weights), '.3g')}; reference skipped "
                         "fraction by threshold: " + ", ".join(f"{k}: {v:.1%}" for k, v in curve.items()))
        lines += [
            "",
            "| weights | config | compiled | ms | vs stock | rel-L1 | skipped | route skipped | routes | note |",
            "|---|---|---|---:|---:|---:|---:|---:|---|---|",
        ]
        for r in (r for r in rows if r.model == m.model):
            routes = "; ".join(f"{role}: {route}" for role, route in r.routes.items())
            note = r.error or "; ".join(f"{role}: {why}" for role, why in r.policy.items())
            config = r.config + (f" {r.threshold:.3g}" if r.threshold is not None else "")
            lines.append(
                f"| {r.weights} | {config} | {'yes' if r.compiled else 'no'} | {_fmt(r.ms, '.1f')} | "
                f"{_fmt(r.vs_stock, '.3f')} | {_fmt(r.rel_l1, '.4f')} | {_fmt(r.skipped, '.1%')} | "
                f"{_fmt(r.skipped_route, '.1%')} | {routes} | {note.replace('|', '/')[:200]} |"
            )
        lines.append("")
    path.write_text("\n".join(lines))


def write_plot(path: Path, results: list[ShapeResult]) -> bool:
    """Speed-up over cuDNN against the reference's skipped fraction, with the ideal 1/(1 - s/2).

    Returns False (and writes nothing) when matplotlib is missing or no skip row was timed.
    """
    points = [
        (res.shape["name"], r.impl + (f" sage {r.quant}" if r.quant else ""), r.skipped_ref, r.vs_baseline)
        for res in results
        for r in res.rows
        if r.skipped_ref is not None and r.vs_baseline is not None
    ]
    if not points:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    s = [i / 100 for i in range(0, 101)]
    ax.plot(s, [1 / (1 - x / 2) for x in s], "k--", label="ideal 1/(1 - s/2)")
    series: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for shape, impl, skipped, speed in points:
        series.setdefault((shape, impl), []).append((skipped, speed))
    for (shape, impl), pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{shape} {impl}", markersize=4)
    dense = [
        (res.shape["name"], r.vs_baseline)
        for res in results
        for r in res.rows
        if r.config == "dense" and r.impl == "fmha-v2" and r.vs_baseline
    ]
    for _, speed in dense:
        ax.plot([0.0], [speed], "kx")
    ax.set_xlabel("skipped tiles (reference, same inputs)")
    ax.set_ylabel("speed-up over cuDNN SDPA dense")
    ax.set_title("Skip-softmax speed-up (x: fmha-v2 dense)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def format_cp_markdown(data: dict[str, Any]) -> str:
    """The context-parallel benchmark's ``NAME.json`` as a Markdown table (``bench cp`` writes both)."""
    latent = "x".join(map(str, data["latent"]))
    ulysses, ring = data["ulysses_degree"], data.get("ring_degree", 1)
    split = " x ".join(f"{name} {n}" for name, n in (("Ulysses", ulysses), ("ring", ring)) if n > 1) or "one GPU"
    lines = _header(f"Context parallelism: one forward over {ulysses * ring} GPU(s) ({split})", data["environment"])
    lines += [
        f"{data['model']}, latent {latent} ({data['tokens']:,} tokens), {data['weights']} weights, "
        f"skip threshold {data['threshold']}, t = {data['t']}. `vs stock`: Diffusers' own attention "
        "(cuDNN SDPA; under Ulysses its context-parallel attention) time / this time, same run; rel-L1: "
        "output against stock's; `skipped`: the skipped-tile fraction of rank 0's calls (its heads; under "
        "ring, its queries over every KV shard, each shard's running max local to it); blank when a skip-softmax "
        "call ran on a route that does not count skipped tiles (fmha-v2).",
        "",
        "| setting | ms | vs stock | rel-L1 | skipped | routes | policy |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for row in data["rows"]:
        routes = "; ".join(f"{role}: {route}" for role, route in row["routes"].items())
        policy = "; ".join(f"{role}: {note}" for role, note in row["policy"].items())
        lines.append(f"| {row['setting']} | {row['time_ms']:.1f} | {row['speed_vs_stock']:.3f} | "
                     f"{row['rel_l1_vs_stock']:.4f} | {_fmt(row['skipped_fraction_rank0'], '.1%')} | {routes} | {policy} |")
    return "\n".join(lines) + "\n"
