"""``kernels.triton_launch`` on the CPU: its key tells Triton's specializations apart, a repeat call reaches the
compiled kernel's launcher with every bound argument (the compiled kernel faked), and whatever the key does not
model, hooks and the interpreter take ``kernel[grid]``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402
from triton.compiler import CompiledKernel  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from diffusers_trtllm.kernels import triton_launch  # noqa: E402
from diffusers_trtllm.kernels.triton_launch import cdiv, launch, launch_key  # noqa: E402

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("this module's kernel must be a JITFunction (TRITON_INTERPRET is set)", allow_module_level=True)


@triton.jit
def _scale(x_ptr, y_ptr, n, a, BLOCK: tl.constexpr, SQUARE: tl.constexpr = False):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(y_ptr + i, a * x * x if SQUARE else a * x, mask=i < n)


def _key(x=None, y=None, n=4096, a=0.5, **kw):
    x = torch.empty(64, dtype=torch.float32) if x is None else x
    y = torch.empty(64, dtype=torch.float32) if y is None else y
    return launch_key(_scale, x, y, n, a, **{"BLOCK": 64, **kw})


def test_key_separates_what_triton_specializes_on():
    base = _key()
    assert base is not None
    assert _key(n=4112, a=3.0) == base  # another multiple of 16, another float value: the same kernel
    assert _key(SQUARE=False) == base  # a default passed is the default left
    assert _key(n=4095) == _key(n=4093) != base
    different = [
        _key(x=torch.empty(64, dtype=torch.float32)[1:]),  # 4 bytes off 16-byte alignment
        _key(x=torch.empty(64, dtype=torch.float16)),
        _key(n=1), _key(n=2**31), _key(n=2**63),
        _key(BLOCK=128), _key(SQUARE=True),
        _key(num_warps=8), _key(num_stages=2),
        _key(a=1),  # an int where a float was: Triton types it i32
    ]
    assert len({base, *different}) == len(different) + 1


def test_unkeyed_arguments_take_the_normal_path():
    assert _key(n=torch.tensor(3).numpy()[()]) is None  # a numpy int: not modelled
    assert launch_key(_scale, torch.empty(4)) is None  # a required argument missing: Triton raises it
    assert launch_key(lambda: None) is None  # no JITFunction


class _FakeCompiled(CompiledKernel):
    """A compiled kernel whose launcher records its arguments (``CompiledKernel.run`` is its ``_run``)."""

    def __init__(self):
        self.calls, self.function, self.packed_metadata, self.module = [], 7, "metadata", None
        self._run = lambda *args: self.calls.append(args)


@pytest.fixture
def faked(monkeypatch):
    """``kernel[grid]`` counted and returning a fake compiled kernel; device 0, stream 99."""
    compiled, normal = _FakeCompiled(), []

    def getitem(self, grid):
        return lambda *args, **kwargs: normal.append((grid, args, kwargs)) or compiled

    monkeypatch.setattr(JITFunction, "__getitem__", getitem)
    monkeypatch.setattr(triton_launch, "_DRIVER_CALLS", (lambda: 0, lambda device: 99))
    monkeypatch.setattr(triton_launch, "_KERNELS", {})
    return compiled, normal


def test_repeat_call_launches_the_compiled_kernel_directly(faked):
    compiled, normal = faked
    x, y = torch.empty(64), torch.empty(64)
    launch(_scale, (4,), x, y, 64, 0.5, BLOCK=64, num_warps=4)
    assert len(normal) == 1 and compiled.calls == []
    launch(_scale, (5, 2), x, y, 48, 0.25, BLOCK=64, num_warps=4)
    assert len(normal) == 1
    assert compiled.calls == [(5, 2, 1, 99, 7, "metadata", None, None, None, x, y, 48, 0.25, 64, False)]
    launch(_scale, (4,), x[1:], y, 64, 0.5, BLOCK=64, num_warps=4)  # another specialization: compiled anew
    assert len(normal) == 2


def test_hooks_take_the_normal_path(faked, monkeypatch):
    compiled, normal = faked
    x, y = torch.empty(64), torch.empty(64)
    launch(_scale, (4,), x, y, 64, 0.5, BLOCK=64)
    hook = lambda *args: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch(_scale, (4,), x, y, 64, 0.5, BLOCK=64)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(normal) == 2 and compiled.calls == []
    monkeypatch.setattr(_scale, "pre_run_hooks", [hook])
    launch(_scale, (4,), x, y, 64, 0.5, BLOCK=64)
    assert len(normal) == 3 and compiled.calls == []


def test_interpreter_takes_the_normal_path_with_the_same_results():
    script = textwrap.dedent("""
        import torch, triton, triton.language as tl
        from diffusers_trtllm.kernels.triton_launch import launch, _KERNELS

        @triton.jit
        def scale(x_ptr, y_ptr, n, a, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(y_ptr + i, a * tl.load(x_ptr + i, mask=i < n), mask=i < n)

        x = torch.randn(100)
        want, got = torch.empty(100), torch.empty(100)
        scale[(4,)](x, want, 100, 0.5, BLOCK=32)
        for _ in range(2):
            launch(scale, (4,), x, got, 100, 0.5, BLOCK=32)
        assert torch.equal(got, want) and not _KERNELS, _KERNELS
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_cdiv_is_tritons():
    """The host's grids: ``triton.cdiv``'s values without its constexpr-function call."""
    for a in (0, 1, 127, 128, 129, 4608, 16896):
        for b in (1, 16, 128):
            assert cdiv(a, b) == triton.cdiv(a, b)


def test_bound_launch_binds_once_and_keeps_no_tensor(faked):
    compiled, normal = faked
    x, y = torch.empty(64), torch.empty(64)
    bound = triton_launch.BoundLaunch(_scale, (4,), x, y, 64, 0.5, BLOCK=64, num_warps=4)
    assert bound.args == (None, None, 64, 0.5)  # the tensors' places, not the tensors
    bound(x, y)
    assert len(normal) == 1 and compiled.calls == []
    assert bound.found[3] == [None, None, 64, 0.5, 64, False]  # nothing of the first call's tensors kept
    x2, y2 = torch.empty(64), torch.empty(64)
    bound(x2, y2)
    assert len(normal) == 1
    assert compiled.calls == [(4, 1, 1, 99, 7, "metadata", None, None, None, x2, y2, 64, 0.5, 64, False)]
    bound(torch.empty(64, dtype=torch.float16), y2)  # another dtype: launch's path, its own key
    assert len(normal) == 2
    bound(x2[1:], y2)  # off alignment: launch's path
    assert len(normal) == 3
    with pytest.raises(TypeError, match="takes 2 tensors"):
        bound(x2)


def test_bound_launch_takes_the_normal_path_under_hooks(faked):
    compiled, normal = faked
    x, y = torch.empty(64), torch.empty(64)
    bound = triton_launch.BoundLaunch(_scale, (4,), x, y, 64, 0.5, BLOCK=64)
    bound(x, y)
    hook = lambda *args: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        bound(x, y)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(normal) == 2 and compiled.calls == []


def test_quantizer_plan_repeats_launch_the_first_calls_arguments(faked, monkeypatch):
    """The quantizer's plan per call shape (``triton_quant._QuantPlan``): a repeat call hands the compiled kernels'
    launchers, in order, every argument ``kernel[grid]`` took on the first call, this call's tensors in their places."""
    from diffusers_trtllm.config import QuantConfig
    from diffusers_trtllm.kernels import triton_quant
    from diffusers_trtllm.layout import PackedLayout

    compiled, normal = faked
    monkeypatch.setattr(triton_quant, "_PLANS", {})  # a plan of another test's would hold its own launchers
    layout = PackedLayout.dense(1, 300, 300, torch.device("cpu"))
    quant = QuantConfig("int8", smooth_k=True)

    def inputs():
        return [torch.randn(300, 4, 64).to(torch.bfloat16) for _ in range(3)]

    first = triton_quant.sage_quantize_triton(*inputs(), layout, quant, mma_key_order=True)
    assert len(normal) == 2 and compiled.calls == []  # Q's tiles beside the stats, then K's and V's
    q, k, v = inputs()
    again = triton_quant.sage_quantize_triton(q, k, v, layout, quant, mma_key_order=True)
    assert len(normal) == 2 and len(compiled.calls) == 2
    for (grid, args, kwargs), call, made in zip(normal, compiled.calls, ([first.q], [first.k, first.vt])):
        kernel = triton_quant._q_and_stats_kernel if "DO_Q" in kwargs else triton_quant._kv_quant_kernel
        want, _, _ = triton_launch._kernel(kernel).bind(args, kwargs)
        assert call[:3] == tuple(grid) + (1,) * (3 - len(grid)) and call[3:9] == (99, 7, "metadata", None, None, None)
        got = list(call[9:])
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            if isinstance(b, torch.Tensor):  # this call's tensor where the first call had its own
                assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, i
                assert not any(a is t for t in made)
            else:
                assert a == b, (i, a, b)
    assert compiled.calls[0][9] is q and compiled.calls[0][12] is again.q
    assert compiled.calls[1][9] is k and compiled.calls[1][11] is again.k and compiled.calls[1][12] is again.vt
