"""Where a transformer forward's GPU time goes, per kernel, for stock Diffusers and processor settings.

    python3 benchmarks/profile_e2e.py --model wan2.1-t2v-14b --configs stock,sage-int8,sage-int8+skip --threshold 0.04

Builds the model as the end-to-end benchmark does (``--weights structured``: its local self-attention), runs one
forward per setting to warm up, then one under ``torch.profiler`` and sums each CUDA kernel's time. What the
whole-forward ratio cannot say: how much of a setting's time is the attention kernel, its quantizer, and copies
or launches the stock forward does not have.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers_trtllm.bench.e2e import SETTINGS, E2EOptions, ModelResult, _ModelBench  # noqa: E402
from diffusers_trtllm.bench.models import MODELS  # noqa: E402
from diffusers_trtllm.locality import local_attention  # noqa: E402


def kernel_times(bench: _ModelBench) -> tuple[float, dict[str, tuple[int, float]]]:
    """One profiled forward: its wall time (ms, CUDA events) and kernel name -> (launches, total ms)."""
    from torch.profiler import ProfilerActivity, profile

    bench.forward()  # warm-up: kernels built (and graphs compiled), caches filled
    bench.forward()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        bench.forward()
        end.record()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = by_name[event.name[:110]]
            entry[0] += 1
            entry[1] += event.device_time / 1e3
    return start.elapsed_time(end), {k: (int(n), ms) for k, (n, ms) in by_name.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="wan2.1-t2v-14b", choices=sorted(MODELS))
    p.add_argument("--configs", default="stock,sage-int8,sage-int8+skip")
    p.add_argument("--threshold", type=float, default=0.04, help="skip-softmax threshold of the +skip settings")
    p.add_argument("--weights", default="structured", choices=("random", "structured"))
    p.add_argument("--compile", default="off", choices=("off", "regional", "full"),
                   help="profile the forward compiled this way (stock compiled the same way)")
    p.add_argument("--backend", default="auto", help="the processor's backend (e.g. sdpa: our processor on cuDNN)")
    p.add_argument("--top", type=int, default=14, help="kernels listed per setting")
    p.add_argument("--out", type=Path, default=None, help="JSON of every kernel's launches and time per setting")
    args = p.parse_args()

    spec = MODELS[args.model]
    opts = E2EOptions(models=(args.model,), configs=tuple(args.configs.split(",")), weights=(args.weights,),
                      compile=args.compile, backend=args.backend)
    result = ModelResult(args.model, spec.describe(), contrast=spec.contrast)
    bench = _ModelBench(spec, opts, result, [])
    if args.compile != "off":
        bench.compile()
    structure = (local_attention(bench.model, spec.contrast, seed=0) if args.weights == "structured"
                 else contextlib.nullcontext())
    report: dict[str, dict] = {}
    with structure:
        for name in opts.configs:
            bench.install(SETTINGS[name], args.threshold)
            wall, kernels = kernel_times(bench)
            report[name] = {"wall_ms": wall, "kernel_ms": sum(ms for _, ms in kernels.values()), "kernels": kernels}
            print(setting_table(name, report[name], args.top), flush=True)
    bench.close()
    if args.out is not None:
        result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
                  "settings": report}
        args.out.write_text(json.dumps(result, indent=1))
        args.out.with_suffix(".md").write_text(markdown(result, args.top))


def setting_table(name: str, setting: dict, top: int) -> str:
    """One setting's forward time and its ``top`` kernels by time, as Markdown."""
    total = setting["kernel_ms"]
    lines = [f"## {name}: forward {setting['wall_ms']:.1f} ms, kernels {total:.1f} ms "
             f"(GPU idle {setting['wall_ms'] - total:.1f} ms)", "", "| kernel | launches | ms | share |",
             "|---|---:|---:|---:|"]
    ranked = sorted(setting["kernels"].items(), key=lambda kv: -kv[1][1])[:top]
    lines += [f"| `{kname}` | {n} | {ms:.1f} | {ms / total:.1%} |" for kname, (n, ms) in ranked]
    return "\n".join(lines) + "\n"


def markdown(result: dict, top: int) -> str:
    """The whole report: each setting's table, then each non-stock setting's kernels that differ from stock's."""
    settings = result["settings"]
    parts = [f"GPU {result['gpu']}, torch {result['torch']}; `{result['command']}`\n"]
    parts += [setting_table(name, setting, top) for name, setting in settings.items()]
    stock = settings.get("stock", {}).get("kernels", {})
    for name, setting in settings.items():
        if name == "stock" or not stock:
            continue
        ours = setting["kernels"]
        diffs = sorted(((ours.get(k, (0, 0.0))[1] - stock.get(k, (0, 0.0))[1], k) for k in {*ours, *stock}),
                       key=lambda d: d[0])
        parts.append(f"## {name} against stock (ms, kernels that moved by more than 1 ms or launch a different "
                     "number of times)\n\n| kernel | stock launches | launches | ms |\n|---|---:|---:|---:|")
        parts += [f"| `{k}` | {stock.get(k, (0, 0))[0]} | {ours.get(k, (0, 0))[0]} | {d:+.1f} |" for d, k in diffs
                  if abs(d) > 1 or stock.get(k, (0, 0))[0] != ours.get(k, (0, 0))[0]]
        parts.append("")
    return "\n".join(parts)


if __name__ == "__main__":
    main()
