"""Where one attention call's time goes, on the host and on the GPU (issue 57), beside cuDNN and SageAttention2.

    python3 benchmarks/profile_call.py --shapes flux_1024,flux_2048=1:16896:24:128 --k-mean 4 --out X.json
    PYTHONPATH=.base python3 benchmarks/profile_call.py ... --label baseline   (another copy of the package, same run)

Per shape and call (``CALLS``): the whole call's median CUDA-event time (each call alone on an idle GPU, so the
host's work before and between its launches counts, as in ``bench_sage_sm90.py``), its ratio to cuDNN in the same
run, rel-L1 and cosine against fp32 dense attention on four heads; the host's wall and CPU time to issue one call
while the GPU is busy (``host_us``, ``cpu_us``); for our calls the same with every GPU launch of the route replaced
by nothing (``python_us``: our Python alone); and one ``torch.profiler`` trace of ``--trace-calls`` calls: each
launch, its GPU time, and the GPU's idle gaps inside a call (``trace``: per call, kernels in order). ``served-*``
calls are the processor's on a bound layer, as a Diffusers model's eager forward makes them (``served-op-*``:
through its custom op, as a compiled forward does).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import diffusers_trtllm
from diffusers_trtllm import attention
from diffusers_trtllm.bench.inputs import parse_shapes, structured_qkv
from diffusers_trtllm.bench.suite import heads_subset
from diffusers_trtllm.bench.timing import time_fn
from diffusers_trtllm.measure import cosine, rel_l1

#: name -> keyword arguments of ``attention`` (None: not ours).
CALLS = {
    "cudnn": None,
    "sageattn": None,
    "ours-default": {},
    "ours-int8-auto": {"quant": "int8"},
    "ours-int8-sage-sm90": {"quant": "int8", "backend": "sage-sm90", "policy": "always"},
    "ours-int8-triton": {"quant": "int8", "backend": "triton", "policy": "always"},
    "served-default": {},
    "served-int8": {"quant": "int8", "policy": "always"},
    "served-op-default": {},
}


def _served(kwargs: dict, q, k, v, op: bool):
    """The processor's attention call on a bound layer (tiny Flux on the GPU: the layer's state does not depend on
    the module's size), as a Diffusers model's eager forward makes it (``op``: through the custom op, as a
    compiled one does)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import tiny_models

    from diffusers_trtllm import TrtllmAttnProcessor, install
    from diffusers_trtllm.serving.layer import layer_of

    model, inputs = tiny_models.build("flux")
    model = model.to("cuda", torch.bfloat16)
    proc = TrtllmAttnProcessor(quant=kwargs.get("quant"), policy=kwargs.get("policy", "auto"))
    install(model, proc)
    state = layer_of(model.transformer_blocks[0].attn)
    text = 512
    if op:  # through the custom op, as under torch.compile
        op = torch.ops.diffusers_trtllm.attention
        return lambda: op(q, k, v, None, None, None, state.key, None, q.shape[1] - text, text, False)
    return lambda: state.serve(q, k, v, None, None, None, None, q.shape[1] - text, text, False)  # as eager calls it


def _stub_routes():
    """Replace every route's ``run`` by one that launches nothing (returns a preallocated output), to time our
    Python alone; returns the undo."""
    from diffusers_trtllm.routing.registry import AttentionResult, registered_routes

    saved = {}
    for name, route in registered_routes().items():
        saved[name] = route.__dict__.get("run")
        out = {}

        def run(call, name=name, out=out):
            key = (tuple(call.q.shape), call.q.dtype)
            if key not in out:
                out[key] = torch.empty_like(call.q)
            return AttentionResult(out[key], name)
        route.run = run

    def undo():
        for name, route in registered_routes().items():
            if saved[name] is None:
                del route.run
            else:
                route.run = saved[name]
    return undo


def host_times(fn, calls: int = 30, sleep_cycles: int = 0) -> tuple[float, float]:
    """Wall and CPU (thread) microseconds to issue one call, the GPU running behind (``sleep_cycles``: behind a GPU
    sleep first, so that no launch waits for the GPU)."""
    fn()
    torch.cuda.synchronize()
    if sleep_cycles:
        torch.cuda._sleep(sleep_cycles)
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    torch.cuda.synchronize()
    return wall / calls * 1e6, cpu / calls * 1e6


def trace(fn, calls: int, path: Path) -> list[dict]:
    """Each of ``calls`` calls under ``torch.profiler``: its kernels (name, GPU us, gap before it), its GPU busy
    time and span, and its host time (``record_function``'s range)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            with record_function(f"call{i}"):
                fn()
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    with open(path, "rb") as f, gzip.open(f"{path}.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    path.unlink()
    ranges = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                    if e.get("cat") == "user_annotation" and e.get("name", "").startswith("call"))
    launches = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})]
    kernels = {e["args"].get("correlation"): e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")}
    per_call = []
    for start, end, name in ranges:
        mine = sorted((kernels[c] for c in (e["args"]["correlation"] for e in launches if start <= e["ts"] <= end)
                       if c in kernels), key=lambda e: e["ts"])
        rows, last = [], None
        for e in mine:
            rows.append(dict(kernel=e["name"][:120], gpu_us=e["dur"], gap_us=None if last is None else e["ts"] - last))
            last = e["ts"] + e["dur"]
        busy = sum(r["gpu_us"] for r in rows)
        span = (mine[-1]["ts"] + mine[-1]["dur"] - mine[0]["ts"]) if mine else 0.0
        per_call.append(dict(call=name, host_us=end - start, launches=len(rows), gpu_busy_us=busy, gpu_span_us=span,
                             first_launch_after_us=(mine[0]["ts"] - start) if mine else None, kernels=rows))
    return per_call


def run_shape(shape, names, k_mean, iters, trace_calls, out_dir: Path, label: str) -> list[dict]:
    dev = torch.device("cuda")
    q, k, v = structured_qkv(shape, 0.5, device=dev, k_mean=k_mean)
    scale = shape.head_dim**-0.5
    heads = heads_subset(shape.heads, 4)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        sub = [x[0][:, heads].float().transpose(0, 1)[None] for x in (q, k, v)]
        ref = F.scaled_dot_product_attention(*sub, scale=scale)[0].transpose(0, 1)
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    calls = {}
    for name in names:
        if name == "cudnn":
            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qh, kh, vh, scale=scale).transpose(1, 2)
            calls[name] = cudnn
        elif name == "sageattn":
            try:
                import sageattention
            except ImportError as err:
                print("sageattn unavailable:", err)
                continue
            k_own = k.clone()  # sageattn smooths K in place
            calls[name] = lambda: sageattention.sageattn(q, k_own, v, tensor_layout="NHD", is_causal=False, sm_scale=scale)
        elif name.startswith("served-"):
            calls[name] = _served(CALLS[name], q, k, v, op=name.startswith("served-op-"))
        else:
            calls[name] = lambda kw=CALLS[name]: attention(q, k, v, **kw)
    rows, base = [], None
    for name, fn in calls.items():
        try:
            with torch.inference_mode():
                out = fn()
                t = time_fn(fn, dev, warmup=3, iters=iters, max_seconds=3.0).median_ms
                host_us, cpu_us = host_times(fn)
                python_us = None
                if name.startswith(("ours-", "served-")):
                    undo = _stub_routes()
                    try:
                        python_us = host_times(fn, 200)[1]
                    finally:
                        undo()
                per_call = trace(fn, trace_calls, out_dir / f"trace_{label}_{shape.name}_{name}.json")
        except Exception as err:  # report and go on
            print(f"{shape.name} {name}: FAILED {type(err).__name__}: {err}", flush=True)
            rows.append(dict(label=label, shape=shape.name, call=name, error=f"{type(err).__name__}: {err}"))
            continue
        base = base or t
        o = out.reshape(q.shape)[0][:, heads].float()
        last = per_call[-1]
        row = dict(label=label, shape=shape.name, call=name, ms=t, vs_cudnn=base / t, tflops=shape.flops() / t / 1e9,
                   rel_l1=rel_l1(o, ref), cosine=cosine(o, ref), host_us=host_us, cpu_us=cpu_us, python_us=python_us,
                   launches=last["launches"], gpu_busy_us=statistics.median(c["gpu_busy_us"] for c in per_call),
                   gpu_span_us=statistics.median(c["gpu_span_us"] for c in per_call), trace=per_call)
        rows.append(row)
        print(f"{label:8s} {shape.name:10s} {name:22s} {t:7.3f} ms {base / t:6.3f}x rel-L1 {row['rel_l1']:.4f} "
              f"cos {row['cosine']:.5f} host {host_us:6.1f} us cpu {cpu_us:6.1f} us python "
              f"{python_us if python_us is not None else float('nan'):6.1f} us launches {row['launches']:2d} "
              f"gpu busy {row['gpu_busy_us']:7.1f} us span {row['gpu_span_us']:7.1f} us", flush=True)
        for kr in last["kernels"]:
            print(f"    {kr['gpu_us']:8.1f} us  gap {kr['gap_us'] if kr['gap_us'] is not None else 0:6.1f}  {kr['kernel'][:90]}")
    return rows


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(k_mean: float) -> dict:
    import triton

    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version(), triton=triton.__version__, python=platform.python_version(),
                sageattention=_version("sageattention"), flashinfer=_version("flashinfer-python"),
                diffusers=_version("diffusers"), package=str(Path(diffusers_trtllm.__file__).parent), k_mean=k_mean)


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"GPU {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, Triton {env['triton']}, "
             f"SageAttention {env['sageattention']}, Diffusers {env['diffusers']}; keys with a per-channel mean of "
             f"{env['k_mean']} std; `{result['command']}`", "",
             "`ms`: median CUDA-event time of one call on an idle GPU (host work before and between its launches "
             "included); `host us` / `cpu us`: wall / CPU time to issue one call while the GPU runs behind; "
             "`python us`: CPU time of the same call with every route's launches stubbed out (our Python alone); "
             "`GPU busy` / `span`: the profiler's kernel time and first-start-to-last-end of one call.", "",
             "| run | shape | call | ms | vs cuDNN | rel-L1 | cosine | host us | cpu us | python us | launches | GPU busy us | GPU span us |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['label']} | {r['shape']} | {r['call']} | failed: {r['error']} |" + " |" * 9)
            continue
        py = "" if r["python_us"] is None else f"{r['python_us']:.1f}"
        lines.append(f"| {r['label']} | {r['shape']} | {r['call']} | {r['ms']:.3f} | {r['vs_cudnn']:.3f}x | "
                     f"{r['rel_l1']:.4f} | {r['cosine']:.5f} | {r['host_us']:.1f} | {r['cpu_us']:.1f} | {py} | "
                     f"{r['launches']} | {r['gpu_busy_us']:.1f} | {r['gpu_span_us']:.1f} |")
    lines += ["", "Launches of the last traced call (GPU us, idle gap before it us):", ""]
    for r in result["rows"]:
        if "error" in r:
            continue
        last = r["trace"][-1]
        lines.append(f"- {r['label']} {r['shape']} {r['call']} (host {last['host_us']:.0f} us, first launch after "
                     f"{last['first_launch_after_us'] or 0:.0f} us): "
                     + "; ".join(f"{k['kernel'][:60]} {k['gpu_us']:.1f}" + (f" (gap {k['gap_us']:.1f})" if k['gap_us'] else "")
                                 for k in last["kernels"]))
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="flux_1024")
    p.add_argument("--calls", default=",".join(CALLS))
    p.add_argument("--k-mean", type=float, default=4.0)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--trace-calls", type=int, default=3)
    p.add_argument("--label", default="this")
    p.add_argument("--trace-dir", default=None, help="where the profiler's traces go (gzipped; default: a temporary folder)")
    p.add_argument("--out", default=None, help="JSON results (rows appended to an existing file); Markdown beside it")
    args = p.parse_args()
    out = Path(args.out) if args.out else None
    trace_dir = Path(args.trace_dir) if args.trace_dir else Path(tempfile.mkdtemp())
    trace_dir.mkdir(parents=True, exist_ok=True)
    result = dict(command=" ".join(["python3", *sys.argv]), environment=environment(args.k_mean), rows=[])
    if out and out.exists():
        result["rows"] = json.loads(out.read_text())["rows"]
        result["command"] = json.loads(out.read_text())["command"] + " ; " + result["command"]
    names = [n for n in args.calls.split(",") if n]
    for shape in parse_shapes(args.shapes):
        result["rows"] += run_shape(shape, names, args.k_mean, args.iters, args.trace_calls, trace_dir, args.label)
        if out:
            out.write_text(json.dumps(result, indent=1))
            out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
