"""``kernels.triton_launch`` on a GPU: a repeat call goes straight to the compiled kernel's launcher, without
``JITFunction.run``, and writes bit for bit what ``kernel[grid]`` writes; another specialization compiles anew."""

from __future__ import annotations

import pytest
import torch

from conftest import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from diffusers_trtllm.kernels import triton_launch  # noqa: E402


@triton.jit
def _axpy(x_ptr, y_ptr, out_ptr, n, a, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    y = tl.load(y_ptr + i, mask=i < n)
    tl.store(out_ptr + i, a * (x * x if SQUARE else x) + y, mask=i < n)


@pytest.fixture
def counted_runs(monkeypatch):
    """How many launches went through ``JITFunction.run``."""
    runs = []
    run = JITFunction.run

    def counted(self, *args, **kwargs):
        runs.append(self)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", counted)
    return runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1000, 4096])
def test_direct_launch_matches_the_normal_one(counted_runs, dtype, n):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, y = (torch.randn(n + 8, device="cuda", generator=gen).to(dtype) for _ in range(2))
    grid = (triton.cdiv(n, 128),)
    want = torch.empty(n, dtype=dtype, device="cuda")
    _axpy[grid](x, y, want, n, 0.75, BLOCK=128, SQUARE=True, num_warps=4)
    before = len(counted_runs)
    for _ in range(3):
        got = torch.full((n,), float("nan"), dtype=dtype, device="cuda")
        triton_launch.launch(_axpy, grid, x, y, got, n, 0.75, BLOCK=128, SQUARE=True, num_warps=4)
        assert torch.equal(got, want)
    assert len(counted_runs) - before == 1  # the first call's alone (its key was new)
    # Another specialization (x 4 bytes off alignment, another constexpr) is compiled, then launched directly.
    for square in (False, False):
        want = torch.empty(n, dtype=dtype, device="cuda")
        _axpy[grid](x[2:], y, want, n, 0.75, BLOCK=128, SQUARE=square, num_warps=4)
        got = torch.empty(n, dtype=dtype, device="cuda")
        triton_launch.launch(_axpy, grid, x[2:], y, got, n, 0.75, BLOCK=128, SQUARE=square, num_warps=4)
        assert torch.equal(got, want)
    assert len(counted_runs) - before == 4  # two kernel[grid] calls and one new key's first launch


def test_direct_launch_on_a_side_stream():
    n = 4096
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    want = torch.empty(n, device="cuda")
    _axpy[(n // 256,)](x, y, want, n, 2.0, BLOCK=256, SQUARE=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            got = torch.empty(n, device="cuda")
            triton_launch.launch(_axpy, (n // 256,), x, y, got, n, 2.0, BLOCK=256, SQUARE=False)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(got, want)


def test_bound_launch_repeats_with_new_tensors(counted_runs):
    """``BoundLaunch``: the first call takes ``launch``'s path, repeats with fresh tensors go to the compiled
    kernel's launcher and write ``kernel[grid]``'s bits; a tensor off 16-byte alignment takes ``launch`` again."""
    n = 3000  # two warps: a key no other test makes, so the first call compiles through JITFunction.run
    bound = triton_launch.BoundLaunch(_axpy, (triton.cdiv(n, 128),), torch.empty(0, device="cuda"),
                                      torch.empty(0, device="cuda"), torch.empty(0, device="cuda"), n, 1.5,
                                      BLOCK=128, SQUARE=True, num_warps=2)
    before = len(counted_runs)
    for i in range(3):
        x, y = torch.randn(n + 4, device="cuda"), torch.randn(n, device="cuda")
        want = torch.empty(n, device="cuda")
        _axpy[(triton.cdiv(n, 128),)](x, y, want, n, 1.5, BLOCK=128, SQUARE=True, num_warps=2)
        got = torch.full((n,), float("nan"), device="cuda")
        bound(x, y, got)
        assert torch.equal(got, want), i
    assert len(counted_runs) - before == 3 + 1  # the three kernel[grid] above and the bound launch's first
    want = torch.empty(n, device="cuda")
    _axpy[(triton.cdiv(n, 128),)](x[1:], y, want, n, 1.5, BLOCK=128, SQUARE=True, num_warps=2)
    got = torch.empty(n, device="cuda")
    bound(x[1:], y, got)  # another specialization: compiled by launch (kernel[grid] above made it already)
    assert torch.equal(got, want)
