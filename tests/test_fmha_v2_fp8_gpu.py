"""GPU tests of the ``fmha-v2-fp8`` route (FMHAv2 in e4m3 on SM90) against the reference.

Ragged batches with padding inside each row (as many queries as keys: what the route
serves), structured inputs so skip-softmax has tiles to skip. The bar for accuracy is
the reference's own per-block SAGE fp8 emulation on the same batch.
"""

from __future__ import annotations

import pytest
import torch

from conftest import rel_l1, requires_cuda
from diffusers_trtllm import SkipSoftmaxConfig, run_attention
from diffusers_trtllm.bench.inputs import holed_batch
from diffusers_trtllm.config import QuantConfig
from diffusers_trtllm.kernels import fp8_tensor_quant
from diffusers_trtllm.kernels.fmha_v2 import Q_STEP, kv_step
from diffusers_trtllm.kernels.reference import reference_attention
from diffusers_trtllm.layout import PackedLayout
from diffusers_trtllm.routing.registry import AttentionCall, device_sm, get_route

pytestmark = [pytest.mark.gpu, requires_cuda]

FP8 = {"dtype_qk": "fp8_e4m3"}


@pytest.fixture(autouse=True)
def _needs_route():
    if device_sm(torch.device("cuda")) != 90:
        pytest.skip("needs an SM90 GPU (H100/H200)")
    x = torch.zeros(16, 1, 128, device="cuda", dtype=torch.bfloat16)
    call = AttentionCall(x, x, x, PackedLayout.dense(1, 16, 16, "cuda"), 0.1, quant=QuantConfig(**FP8))
    reasons = get_route("fmha-v2-fp8").not_supported_reasons(call)
    if reasons:
        pytest.skip(f"fmha-v2-fp8 cannot run here: {reasons}")


def _inputs(dim=128, kv_heads=4, queries="equal"):
    """A holed batch: ``[batch, seq, heads, dim]`` Q/K/V and its layout."""
    return holed_batch(head_dim=dim, kv_heads=kv_heads, queries=queries)


def _reference(q, k, v, layout, lam=None, quant=None):
    """The reference on the packed batch (fmha-v2's tiles); its ``out`` is packed ``[tokens, heads, dim]``."""
    q, k, v = layout.pack_q(q), layout.pack_kv(k), layout.pack_kv(v)
    return reference_attention(
        q.float(), k.float(), v.float(), layout.cu_seqlens_q, layout.cu_seqlens_kv, layout.q_lens, layout.kv_lens,
        softmax_scale=q.shape[-1] ** -0.5, skip_factor=None if lam is None else lam * layout.max_seqlen_kv,
        quant=None if quant is None else QuantConfig(**quant), tile_q=Q_STEP, tile_kv=kv_step(q.shape[-1]),
        out_dtype=torch.float32,
    )


def _run(q, k, v, layout, lam=None):
    """``backend="auto"`` with skip-softmax at ``lam``: the output packed, and the route's result."""
    skip = None if lam is None else SkipSoftmaxConfig(threshold=lam)
    # policy="always": these 1.5k-token batches are below the length where SAGE pays (policy.py)
    out, result = run_attention(q, k, v, layout=layout, skip=skip, quant=FP8, policy="always")
    return layout.pack_q(out).float(), result


def test_fused_quantizer_matches_the_torch_path():
    q, k, v, layout = _inputs()
    q, k, v = layout.pack_q(q), layout.pack_kv(k), layout.pack_kv(v)
    fused = fp8_tensor_quant.quantize_fp8_per_tensor(q, k, v)
    kernel, fp8_tensor_quant._triton_kernel = fp8_tensor_quant._triton_kernel, None
    try:
        plain = fp8_tensor_quant.quantize_fp8_per_tensor(q, k, v)
    finally:
        fp8_tensor_quant._triton_kernel = kernel
    assert fused.qk_scale == plain.qk_scale
    for a, b in ((fused.q, plain.q), (fused.kv, plain.kv)):
        differ = (a.float() != b.float()).float().mean().item()
        assert differ < 1e-3  # x * (1/s) and x / s may round apart at ties
        assert rel_l1(a.float(), b.float()) < 1e-3


@pytest.mark.parametrize("dim", [64, 128])
def test_dense_is_as_accurate_as_per_block_sage_fp8(dim):
    q, k, v, layout = _inputs(dim=dim)
    dense = _reference(q, k, v, layout).out
    emulated = rel_l1(_reference(q, k, v, layout, quant=FP8).out, dense)
    out, result = _run(q, k, v, layout)
    assert result.route == "fmha-v2-fp8"
    err = rel_l1(out, dense)
    print(f"D={dim}: fmha-v2-fp8 rel-L1 {err:.4f}, per-block emulation {emulated:.4f}")
    assert not out.isnan().any()
    assert err <= 1.5 * emulated + 5e-3


def test_skip_error_follows_the_reference():
    q, k, v, layout = _inputs()
    dense = _reference(q, k, v, layout).out
    base = rel_l1(_run(q, k, v, layout)[0], dense)
    fractions = []
    for lam in (1e-3, 1e-2, 5e-2, 0.2):
        ref = _reference(q, k, v, layout, lam=lam)
        out, result = _run(q, k, v, layout, lam=lam)
        assert result.route == "fmha-v2-fp8"
        fractions.append(ref.skipped_fraction)
        ref_err, err = rel_l1(ref.out, dense), rel_l1(out, dense)
        print(f"lambda {lam}: skipped {ref.skipped_fraction:.2f}, reference {ref_err:.4f}, fmha-v2-fp8 {err:.4f}")
        assert err <= base + 2.0 * ref_err + 5e-3
    assert fractions[-1] > 0.3


@pytest.mark.parametrize("queries, kv_heads", [("fewer", 4), ("more", 4), ("equal", 2)])
def test_batches_it_refuses_go_elsewhere(queries, kv_heads):
    q, k, v, layout = _inputs(kv_heads=kv_heads, queries=queries)
    packed = (layout.pack_q(q), layout.pack_kv(k), layout.pack_kv(v))
    call = AttentionCall(*packed, layout, 128**-0.5, quant=QuantConfig(**FP8))
    assert get_route("fmha-v2-fp8").not_supported_reasons(call)
    out, result = _run(q, k, v, layout)
    assert result.route != "fmha-v2-fp8" and not out.isnan().any()
