"""Our Python's CPU cost for one served attention call, with every route's launches stubbed out (issue 57), on a
machine without a GPU: ``profile_call.py``'s ``python_us`` where it cannot run.

    python benchmarks/profile_python_cpu.py [--quant int8] [--backend reference] [--calls 20000]
    python benchmarks/profile_python_cpu.py --quant ''      (dense: no SAGE)

A tiny Flux's first joint attention layer, bound by ``install``, served through ``LayerState.serve`` (as a
Diffusers model's eager forward calls it) and through ``attention`` directly, on CPU tensors of Flux 1024²'s
shape (the plan cache keys on shapes, not values); the route's ``run`` returns a preallocated output. With int8,
``quantizer`` is the ``sage-sm90`` route's quantizer (``sage_quantize_triton``) with Triton's compiled launcher
faked: its own Python and our launch path, which an int8 call adds to the route's; ``sage-sm90`` the route's whole
call (quantizer included) with the device taken for an SM90 GPU and every launch stubbed. Both on meta tensors.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from profile_call import _stub_routes  # noqa: E402

from diffusers_trtllm import TrtllmAttnProcessor, attention, install  # noqa: E402
from diffusers_trtllm.serving.layer import layer_of  # noqa: E402


def cpu_us(fn, calls: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the CPU (thread) microseconds of one call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        times.append((time.thread_time() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quant", default="int8", help="SAGE dtype; '' for none (dense)")
    p.add_argument("--backend", default="reference")
    p.add_argument("--tokens", type=int, default=4608, help="image and text tokens (Flux 1024²: 4,096 + 512)")
    p.add_argument("--calls", type=int, default=20000)
    args = p.parse_args()
    args.quant = args.quant or None
    import tiny_models

    model, _ = tiny_models.build("flux")
    proc = TrtllmAttnProcessor(quant=args.quant, backend=args.backend, policy="always")
    install(model, proc)
    state = layer_of(model.transformer_blocks[0].attn)
    text = 512
    q, k, v = (torch.randn(1, args.tokens, 24, 128, dtype=torch.bfloat16) for _ in range(3))
    calls = {
        "served": lambda: state.serve(q, k, v, None, None, None, None, args.tokens - text, text, False),
        "attention": lambda: attention(q, k, v, quant=args.quant, backend=args.backend, policy="always"),
    }
    if args.quant == "int8":
        # On the meta device: large CPU buffers cost the CPU's allocator far more, and more unevenly, than CUDA's
        # caching allocator, which reuses its blocks.
        packed = [torch.empty(x.shape[1:], dtype=x.dtype, device="meta") for x in (q, k, v)]
        calls["quantizer"] = _stubbed_quantizer(*packed)
        calls["sage-sm90"] = _stubbed_sage_sm90(*packed)
    undo = _stub_routes()
    try:
        with torch.inference_mode():
            for name, fn in calls.items():
                print(f"{name:10s} {cpu_us(fn, args.calls):6.2f} us CPU per call (routes stubbed)")
    finally:
        undo()


def _fake_triton_launcher() -> None:
    """Triton's compiled launcher faked: our launch path runs whole (``triton_launch``: the key, or a bound launch's
    checks) up to the launcher, which does nothing."""
    from triton.compiler import CompiledKernel
    from triton.runtime.jit import JITFunction

    from diffusers_trtllm.kernels import triton_launch

    class Compiled(CompiledKernel):
        def __init__(self):
            self.function, self.packed_metadata, self.module = 0, None, None
            self._run = lambda *args: None

    compiled = Compiled()
    JITFunction.__getitem__ = lambda self, grid: lambda *args, **kwargs: compiled
    triton_launch._DRIVER_CALLS = (lambda: 0, lambda device: 0)


def _stubbed_quantizer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``sage_sm90_quantize`` of packed Q, K, V with Triton's compiled launcher faked (``_fake_triton_launcher``)."""
    from diffusers_trtllm.config import QuantConfig
    from diffusers_trtllm.kernels.sage_sm90 import sage_sm90_quantize
    from diffusers_trtllm.layout import PackedLayout

    _fake_triton_launcher()
    layout = PackedLayout.dense(1, q.shape[0], k.shape[0], q.device)
    quant = QuantConfig("int8")
    return lambda: sage_sm90_quantize(q, k, v, layout, quant)


def _stubbed_sage_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``sage_sm90_attention`` of packed Q, K, V (the ``sage-sm90`` route's call, quantizer included) on the CPU:
    the device taken for an SM90 GPU, Triton's compiled launcher faked (``_fake_triton_launcher``), the TMA maps'
    encoding (not their cache) and the kernel's launch stubbed."""
    from diffusers_trtllm.config import QuantConfig
    from diffusers_trtllm.kernels import cuda_jit, sage_sm90
    from diffusers_trtllm.layout import PackedLayout

    _fake_triton_launcher()

    class Kernel:
        def launch(self, grid, block, arguments, stream):
            pass

    class Map:
        address = 0

    sage_sm90.device_sm = lambda device: 90
    sage_sm90._kernel = lambda *args: Kernel()
    cuda_jit.current_stream = lambda device: 0
    cuda_jit.TensorMap.bytes_2d = classmethod(lambda cls, *args: Map())
    layout = PackedLayout.dense(1, q.shape[0], k.shape[0], q.device)
    quant = QuantConfig("int8")
    scale = q.shape[-1] ** -0.5
    return lambda: sage_sm90.sage_sm90_attention(q, k, v, layout, softmax_scale=scale, quant=quant)


if __name__ == "__main__":
    main()
