"""CPU tests of the ``fmha-v2-fp8`` route: its contract with FlashInfer, with the kernel replaced.

The fake ``trtllm_fmha_v2_prefill`` (``fake_fmha_v2``) has FlashInfer 0.7.4's signature, checks every
argument the route hands it (layout name, e4m3 tensors in ``CONTIGUOUS_Q_KV``,
scales, output dtype, mask mode, skip factor) and computes what the kernel computes:
``softmax(bmm1_scale * q8 @ k8^T) @ v8 * bmm2_scale`` per sequence, in fp32, and its softmax stats.
"""

from __future__ import annotations

import types

import pytest
import torch

from conftest import rel_l1
from fake_fmha_v2 import fake_trtllm_fmha_v2_prefill
from diffusers_trtllm.config import QuantConfig
from diffusers_trtllm.kernels import fa3, flashinfer_support, fmha_v2_fp8
from diffusers_trtllm.kernels.fp8_tensor_quant import quantize_fp8_per_tensor, restore_output
from diffusers_trtllm.kernels.reference import reference_attention
from diffusers_trtllm.layout import PackedLayout
from diffusers_trtllm.routing import AttentionCall, get_route, order, select_route

FP8 = QuantConfig(dtype_qk="fp8_e4m3")


def _fake_prefill(calls: list):
    """FlashInfer's kernel (``fake_fmha_v2``), with the e4m3 ``CONTIGUOUS_Q_KV`` contract checked first."""
    kernel = fake_trtllm_fmha_v2_prefill(calls)

    def trtllm_fmha_v2_prefill(qkv, input_layout, *args, out_dtype=None, bmm2_scale=1.0, **kwargs):
        q, kv = qkv
        assert input_layout == "CONTIGUOUS_Q_KV"
        assert q.dtype == kv.dtype == torch.float8_e4m3fn and q.is_contiguous() and kv.is_contiguous()
        assert out_dtype in (torch.bfloat16, torch.float16) and bmm2_scale == 1.0
        return kernel(qkv, input_layout, *args, out_dtype=out_dtype, bmm2_scale=bmm2_scale, **kwargs)

    return trtllm_fmha_v2_prefill


@pytest.fixture
def fake_fi(monkeypatch):
    calls: list = []
    fi = types.SimpleNamespace(prefill=types.SimpleNamespace(trtllm_fmha_v2_prefill=_fake_prefill(calls)))
    monkeypatch.setattr(flashinfer_support, "_import", lambda: (fi, None))
    monkeypatch.setattr(flashinfer_support, "jit_built", lambda uri: True)
    monkeypatch.setattr(fa3, "module_uri", lambda call: "fa3_module")  # the fake has no JIT module names
    return calls


def _ragged(lens=(96, 40), heads=2, dim=64, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q, k, v = (torch.randn(total, heads, dim, generator=gen, dtype=dtype) for _ in range(3))
    k = k + 3.0 * torch.randn(1, heads, dim, generator=gen)  # a shared component: what smoothing removes
    v = v * torch.linspace(0.1, 4.0, dim) + 1.5  # channels of different size and an offset
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    layout = PackedLayout.from_cu_seqlens(cu, cu, max(lens), max(lens), q_tokens=total, kv_tokens=total)
    return q, k, v, layout


def _dense(q, k, v, layout, scale):
    return reference_attention(
        q.float(), k.float(), v.float(), layout.cu_seqlens_q, layout.cu_seqlens_kv, layout.q_lens, layout.kv_lens,
        softmax_scale=scale, out_dtype=torch.float32,
    ).out


def test_route_hands_flashinfer_fp8_contiguous_q_kv_and_restores_v(fake_fi, monkeypatch):
    q, k, v, layout = _ragged(dtype=torch.bfloat16)
    call = AttentionCall(q, k, v, layout, 0.125, skip_factor=7.0, quant=FP8)
    result = get_route("fmha-v2-fp8").run(call)
    (args,) = fake_fi
    assert args["skip"] == 7.0 and args["out_dtype"] == torch.bfloat16
    quant = quantize_fp8_per_tensor(q, k, v)
    assert args["bmm1_scale"] == pytest.approx(0.125 * quant.qk_scale)
    assert result.route == "fmha-v2-fp8" and result.out.dtype == torch.bfloat16
    # fp8's three mantissa bits, as the per-block reference emulation pays them
    assert rel_l1(result.out.float(), _dense(q, k, v, layout, 0.125)) < 0.05


def test_per_tensor_quantization_is_exact_up_to_fp8_rounding():
    q, k, v, layout = _ragged()
    quant = quantize_fp8_per_tensor(q, k, v)
    q_scale = q.abs().amax() / 448
    k_smooth = k - k.mean(0)
    assert quant.q.float().abs().max() <= 448 and quant.kv.float().abs().max() <= 448
    assert rel_l1(quant.q.float() * q_scale, q) < 0.04  # e4m3: half an ulp is 1/16 relative
    assert quant.qk_scale == pytest.approx(float(q_scale * k_smooth.abs().amax() / 448), rel=1e-6)
    v_back = quant.kv[:, 1].float() * quant.v_scale + quant.v_mean
    assert rel_l1(v_back, v) < 0.04
    # Smoothing: K's shared component is gone, V's channels each use the full range.
    assert quant.kv[:, 0].float().mean(0).abs().max() < 2.0
    assert torch.allclose(quant.kv[:, 1].float().abs().amax(0), torch.full_like(quant.v_scale, 448.0))


def test_restore_output_undoes_v_smoothing_through_attention():
    """Rows of P sum to one, so P·((v - mean) / scale) * scale + mean is P·v."""
    q, k, v, layout = _ragged(lens=(64,))
    quant = quantize_fp8_per_tensor(q, k, v)
    v_scaled = (v - quant.v_mean) / quant.v_scale
    out = restore_output(_dense(q, k, v_scaled, layout, 0.125), quant)
    assert torch.allclose(out, _dense(q, k, v, layout, 0.125), atol=1e-4)


def test_restore_output_repeats_scales_for_grouped_heads():
    q, k, v, layout = _ragged(heads=4)
    quant = quantize_fp8_per_tensor(q, k[:, :2], v[:, :2])
    out = restore_output(torch.ones(q.shape), quant)
    assert torch.equal(out[:, 0], out[:, 1]) and torch.equal(out[:, 2], out[:, 3])


def test_reasons_and_rank(fake_fi, monkeypatch):
    route = get_route("fmha-v2-fp8")
    q, k, v, layout = _ragged(dtype=torch.bfloat16)
    dense = AttentionCall(q, k, v, layout, 0.1)
    sage = AttentionCall(q, k, v, layout, 0.1, quant=FP8)
    int8 = AttentionCall(q, k, v, layout, 0.1, quant=QuantConfig(dtype_qk="int8"))
    assert any("not cpu" in r for r in route.not_supported_reasons(sage))
    assert any("fp8 SAGE calls only" in r for r in route.extra_reasons(dense))
    assert any("no SAGE with dtype_qk=int8" in r for r in route.not_supported_reasons(int8))
    assert route.extra_reasons(sage) == []
    monkeypatch.setattr(order, "device_sm", lambda device: 90)
    assert order.ranked_routes(sage)[0] == "fmha-v2-fp8"
    assert select_route(dense).name == "sdpa"  # CPU: never this route


def test_module_uri_matches_flashinfer_naming():
    assert fmha_v2_fp8.module_uri(torch.bfloat16) == "trtllm_fmha_v2_contiguous_q_kv_e4m3_bf16"


def test_lse_from_softmax_stats_adds_back_k_smoothing(fake_fi):
    """The kernel's stats (faked) give the LSE of the unquantized logits once K's smoothing mean is added back,
    so two KV shards, each quantized with its own mean, merge by Diffusers' ring formula into one call's result."""
    from diffusers_trtllm.bench.ring_skip import merge_by_lse

    q, k, v, layout = _ragged(lens=(128,), dtype=torch.bfloat16)
    whole = reference_attention(q.float(), k.float(), v.float(), layout.cu_seqlens_q, layout.cu_seqlens_kv,
                                layout.q_lens, layout.kv_lens, softmax_scale=0.125)
    route = get_route("fmha-v2-fp8")
    assert route.run(AttentionCall(q, k, v, layout, 0.125, quant=FP8)).lse is None
    assert fake_fi[-1]["stats"] is False
    result = route.run(AttentionCall(q, k, v, layout, 0.125, quant=FP8, return_lse=True))
    assert fake_fi[-1]["stats"] is True and fake_fi[-1]["layout"] == "CONTIGUOUS_Q_KV"
    assert result.lse.shape == (128, 2) and result.lse.dtype == torch.float32
    assert (result.lse - whole.lse).abs().max() < 0.05  # fp8 rounding; unsmoothed, K's mean moves it by ~3
    parts = []
    for half in (slice(0, 64), slice(64, 128)):
        shard = PackedLayout.dense(1, 128, 64, "cpu")
        res = route.run(AttentionCall(q, k[half], v[half], shard, 0.125, quant=FP8, return_lse=True, kv_shards=2))
        parts.append((res.out, res.lse))
    out, lse = merge_by_lse(parts)
    assert (lse - whole.lse).abs().max() < 0.05
    assert rel_l1(out, whole.out.float()) < 0.05
