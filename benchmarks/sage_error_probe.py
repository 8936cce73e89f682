"""SAGE's error on a model's own Q/K/V, per quantization setting and kernel.

    python3 benchmarks/sage_error_probe.py --models wan2.1-t2v-1.3b --variant full --latent 16,5,30,52 \
        --calls 0,10,20,29 --out benchmarks/results/sage_error_probe_cpu.json
    python3 benchmarks/sage_error_probe.py --models wan2.1-t2v-1.3b --variant full --calls 0,10,20,29 --device cuda
    python3 benchmarks/sage_error_probe.py --models wan2.1-t2v-1.3b --calls 0 --queries 128 --k-mean 4 \
        --out benchmarks/results/sage_error_probe_cpu_kmean.json

Builds a model with random weights (``probe``: one block, two heads at the published geometry; ``full``:
the published config, with ``--latent`` to shorten it on a CPU), records the Q, K, V of its self/joint
attention calls numbered ``--calls`` in one forward, and on a sample of each call's queries against all
its keys runs the reference's SAGE emulation (``reference_attention`` with ``quant``, and ``smooth_v`` for the
project's Hopper kernels' recipe: what every SAGE kernel here computes) per setting and, with ``--device cuda``, the GPU kernels themselves (``sage-sm90``,
``triton``, SageAttention2), each with rel-L1 and cosine against fp32 dense. It tells which choices
(``smooth_k``, block sizes, the kernel) move the error on a model's activations, where the kernel benches
use synthetic inputs. Random weights are not a trained model: read the ranking, not the exact figures. Their
keys have almost no per-channel mean, trained models' have one of a few standard deviations: ``--k-mean S``
adds one of ``S`` standard deviations of K to the recorded keys (softmax is unchanged by it, quantization not).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
from collections.abc import Callable

import torch
from tqdm import tqdm

from bench_sage_sm90 import write_result
from diffusers_trtllm.bench.inputs import spy_sdpa
from diffusers_trtllm.bench.models import MODELS, build_model, model_inputs
from diffusers_trtllm.config import QuantConfig
from diffusers_trtllm.kernels.reference import reference_attention
from diffusers_trtllm.measure import cosine, rel_l1

#: The emulated recipes: (quantization, ``smooth_v``). FlashInfer's quantizer keeps V's mean in (the rows without
#: ``smooth_v``); the project's Hopper kernels (``sage-sm90``, ``triton``, ``gluon``) take it off (the rows with it).
SETTINGS = {
    "int8 (q 1, k 16)": (QuantConfig("int8", 1, 16, smooth_k=False), False),
    "int8 (q 1, k 16) + smooth_k": (QuantConfig("int8", 1, 16, smooth_k=True), False),
    "int8 (q 1, k 4)": (QuantConfig("int8", 1, 4, smooth_k=False), False),
    "int8 (q 1, k 4) + smooth_k": (QuantConfig("int8", 1, 4, smooth_k=True), False),
    "int8 (q 1, k 128)": (QuantConfig("int8", 1, 128, smooth_k=False), False),
    "int8 (q 1, k 128) + smooth_k": (QuantConfig("int8", 1, 128, smooth_k=True), False),
    "fp8 (q 1, k 16)": (QuantConfig("fp8_e4m3", 1, 16, smooth_k=False), False),
    "fp8 (q 1, k 16) + smooth_k": (QuantConfig("fp8_e4m3", 1, 16, smooth_k=True), False),
    "int8 (q 1, k 16) + smooth_v": (QuantConfig("int8", 1, 16, smooth_k=False), True),
    "int8 (q 1, k 128) + smooth_v": (QuantConfig("int8", 1, 128, smooth_k=False), True),
}

#: The GPU kernels ``--device cuda`` runs beside the emulation (``kernels``), by route name.
KERNELS = ("fa3", "fmha-v2-fp8", "sage-sm90", "triton", "sageattn")


class _Recorded(Exception):
    pass


def record_qkv(name: str, variant: str, latent: tuple[int, ...] | None, calls: tuple[int, ...], seed: int,
               device: str) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``[tokens, heads, dim]`` float32 Q, K, V of the self/joint attention calls numbered ``calls`` (0: the first
    call whose queries are its keys) of one forward of the model with random weights."""
    spec = MODELS[name]
    model = build_model(spec, device=device, dtype=torch.bfloat16, seed=seed, variant=variant)
    inputs = model_inputs(spec, model, t=0.5, device=device, dtype=torch.bfloat16, seed=seed, latent=latent)
    seen: dict[int, tuple[torch.Tensor, ...]] = {}
    count = 0

    def spy(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        nonlocal count
        if q.shape[-2] != k.shape[-2]:
            return
        if count in calls:
            seen[count] = tuple(x[0].transpose(0, 1).float() for x in (q, k, v))
        count += 1
        if len(seen) == len(calls):
            raise _Recorded

    with spy_sdpa(spy), torch.no_grad(), contextlib.suppress(_Recorded):
        model(**inputs)
    return seen


def run_model(name: str, variant: str, latent: tuple[int, ...] | None, calls: tuple[int, ...], queries: int,
              seed: int, device: str, chosen: tuple[str, ...] = KERNELS, k_mean: float = 0.0) -> list[dict]:
    rows = []
    for call, (q, k, v) in record_qkv(name, variant, latent, calls, seed, device).items():
        if k_mean:  # a channel mean shared by every key, as trained models' keys carry
            gen = torch.Generator(device=k.device).manual_seed(seed + call)
            k = k + k_mean * k.std() * torch.randn(k.shape[1:], generator=gen, device=k.device)
        rows += run_call(name, call, q, k, v, queries, seed, chosen)
    return rows


def run_call(name: str, call: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, queries: int, seed: int,
             chosen: tuple[str, ...]) -> list[dict]:
    sample = torch.randperm(q.shape[0], generator=torch.Generator().manual_seed(seed))[:queries].sort().values
    qs = q[sample.to(q.device)].contiguous()
    cu_q = torch.tensor([0, qs.shape[0]], dtype=torch.int32, device=q.device)
    cu_kv = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device)
    scale = q.shape[-1] ** -0.5

    def attend(quant: QuantConfig | None, smooth_v: bool = False) -> torch.Tensor:
        return reference_attention(qs, k, v, cu_q, cu_kv, (qs.shape[0],), (k.shape[0],), softmax_scale=scale,
                                   quant=quant, out_dtype=torch.float32, smooth_v=smooth_v).out.float()

    dense = attend(None)
    k_offset = k.mean(dim=0).abs() / k.std(dim=0)  # [heads, dim]: how far K's channels sit from zero
    rows = [dict(model=name, call=call, tokens=k.shape[0], queries=qs.shape[0], heads=q.shape[1], dim=q.shape[2],
                 k_mean_over_std=float(k_offset.mean()), k_mean_over_std_max=float(k_offset.max()))]
    outputs = {label: (lambda recipe=recipe: attend(*recipe)) for label, recipe in SETTINGS.items()}
    if qs.is_cuda:
        outputs.update({label: run for label, run in kernels(qs, k, v, scale).items() if label.split()[0] in chosen})
    for label, run in tqdm(outputs.items(), desc=f"{name} call {call}", unit="setting"):
        try:
            out = run().float()
        except Exception as err:  # a kernel this machine lacks: report and go on
            rows.append(dict(model=name, call=call, setting=label, error=f"{type(err).__name__}: {err}"))
            print(f"{name:18s} call {call:3d} {label:30s} FAILED {rows[-1]['error']}", flush=True)
            continue
        rows.append(dict(model=name, call=call, setting=label, rel_l1=rel_l1(out, dense), cosine=cosine(out, dense)))
        print(f"{name:18s} call {call:3d} {label:30s} rel-L1 {rows[-1]['rel_l1']:.4f} cosine {rows[-1]['cosine']:.5f}",
              flush=True)
    return rows


def kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> dict[str, Callable[[], torch.Tensor]]:
    """The GPU kernels on the same queries: ours through ``attention`` (policy off; fa3 dense bf16 is the floor,
    fmha-v2-fp8 the fp8 route with per-tensor scales) and SageAttention2."""
    from diffusers_trtllm import attention

    def ours(backend: str, quant: QuantConfig | None) -> torch.Tensor:
        x = (t.to(torch.bfloat16)[None] for t in (q, k, v))
        return attention(*x, softmax_scale=scale, quant=quant, backend=backend, policy="always")[0]

    runs = {"fa3 dense bf16": lambda: ours("fa3", None),
            "fmha-v2-fp8": lambda: ours("fmha-v2-fp8", QuantConfig("fp8_e4m3"))}
    runs.update({f"{backend} int8 k{kb}{' + smooth_k' if smooth else ''}": (lambda b=backend, kb=kb, s=smooth: ours(
                b, QuantConfig("int8", 1, kb, smooth_k=s)))
                for backend, kbs in (("sage-sm90", (16, 128)), ("triton", (16,))) for kb in kbs for smooth in (False, True)})
    try:
        import sageattention
    except ImportError as err:
        print("sageattn unavailable:", err)
        return runs
    runs["sageattn (SageAttention2)"] = lambda: sageattention.sageattn(
        *(t.to(torch.bfloat16)[None].contiguous() for t in (q, k, v)), tensor_layout="NHD", is_causal=False,
        sm_scale=scale)[0]  # (it smooths its own copy of K)
    return runs


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"{env['device']}, torch {env['torch']}, diffusers {env['diffusers']}; `{result['command']}`", "",
             "| model | call | tokens | K mean / K std (mean, max) | setting | rel-L1 | cosine |",
             "|---|---:|---:|---:|---|---:|---:|"]
    for r in result["rows"]:
        if "setting" not in r:
            info = r
            continue
        head = (f"| {r['model']} | {r['call']} | {info['tokens']} | "
                f"{info['k_mean_over_std']:.2f}, {info['k_mean_over_std_max']:.1f} | {r['setting']} |")
        lines.append(f"{head} failed: {r['error']} | |" if "error" in r else f"{head} {r['rel_l1']:.4f} | {r['cosine']:.5f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="wan2.1-t2v-1.3b,flux.1-dev")
    p.add_argument("--variant", default="probe", choices=("probe", "full"),
                   help="probe: one block, two heads at full geometry; full: the published config")
    p.add_argument("--latent", default=None, help="latent shape instead of the model's, e.g. 16,5,30,52 (Wan)")
    p.add_argument("--calls", default="0", help="self/joint attention calls to record, counted from 0")
    p.add_argument("--queries", type=int, default=512, help="queries sampled per model (all keys are used)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cuda also runs the GPU kernels on the recorded Q/K/V")
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"GPU kernels to run, from {', '.join(KERNELS)}")
    p.add_argument("--k-mean", type=float, default=0.0,
                   help="add to the recorded keys a per-channel mean of this many K standard deviations")
    p.add_argument("--out", default=None, help="JSON results file; a Markdown table is written beside it")
    args = p.parse_args()
    latent = tuple(int(x) for x in args.latent.split(",")) if args.latent else None
    calls = tuple(int(x) for x in args.calls.split(","))
    rows = [row for name in args.models.split(",")
            for row in run_model(name, args.variant, latent, calls, args.queries, args.seed, args.device,
                                 tuple(args.kernels.split(",")), args.k_mean)]
    import diffusers

    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    env = dict(device=gpu, torch=torch.__version__, diffusers=diffusers.__version__, python=platform.python_version(),
               k_mean=args.k_mean)
    print(markdown(dict(environment=env, command="sage_error_probe.py", rows=rows)))
    if args.out:
        write_result(args.out, "sage_error_probe.py", env, rows, markdown)


if __name__ == "__main__":
    main()
