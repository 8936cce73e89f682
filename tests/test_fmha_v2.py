"""CPU tests of the Hopper routes (``fmha-v2``, ``fa3``): their reasons and their place under ``auto``."""

from __future__ import annotations

import math
import types
from dataclasses import replace

import pytest
import torch

from fake_fmha_v2 import fake_trtllm_fmha_v2_prefill
from diffusers_trtllm.kernels import fa3, flashinfer_support, fmha_v2
from diffusers_trtllm.layout import PackedLayout
from diffusers_trtllm.routing import AttentionCall, get_route, order, ranked_routes, route_names, select_route


def _call(dim: int = 128, tokens: int = 256, skip: float | None = None, dtype=torch.bfloat16) -> AttentionCall:
    x = torch.zeros(tokens, 2, dim, dtype=dtype)
    return AttentionCall(x, x, x, PackedLayout.dense(1, tokens, tokens, "cpu"), 0.1, skip_factor=skip)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """FlashInfer importable, kernels not built yet; tests set nvcc and the SM."""
    monkeypatch.setattr(flashinfer_support, "_import", lambda: (types.SimpleNamespace(), None))
    monkeypatch.setattr(flashinfer_support, "jit_built", lambda uri: False)
    monkeypatch.setattr(fa3, "module_uri", lambda call: "fa3_module")
    return monkeypatch


def test_routes_are_registered_in_order():
    names = route_names()
    assert names.index("fa3") < names.index("fmha-v2") < names.index("sdpa")


@pytest.mark.parametrize("name", ["fmha-v2", "fa3"])
def test_cpu_tensors_and_wrong_head_dim_are_reasons(name):
    reasons = get_route(name).not_supported_reasons(_call(dim=96))
    assert any("not cpu" in r for r in reasons)
    assert any("head dim 96" in r for r in reasons)


def test_fa3_has_no_skip_softmax():
    assert "no skip-softmax" in get_route("fa3").not_supported_reasons(_call(skip=10.0))


@pytest.mark.parametrize("name", ["fmha-v2", "fa3"])
def test_missing_flashinfer_is_the_reason(monkeypatch, name):
    monkeypatch.setattr(flashinfer_support, "_import", lambda: (None, "ModuleNotFoundError: No module named 'flashinfer'"))
    reasons = get_route(name).extra_reasons(_call())
    assert len(reasons) == 1 and "flashinfer is not installed" in reasons[0]
    assert "pip install" in reasons[0]


@pytest.mark.parametrize("name", ["fmha-v2", "fa3"])
def test_missing_nvcc_is_the_reason_until_built(fake_flashinfer, name):
    fake_flashinfer.setattr(flashinfer_support, "nvcc_path", lambda: None)
    fake_flashinfer.setattr(fmha_v2, "device_sm", lambda device: 90)
    reasons = get_route(name).extra_reasons(_call())
    assert len(reasons) == 1 and "no nvcc" in reasons[0] and "CUDA_HOME" in reasons[0]
    fake_flashinfer.setattr(flashinfer_support, "jit_built", lambda uri: True)  # a cached build needs no compiler
    assert get_route(name).extra_reasons(_call()) == []


def test_nvcc_from_cuda_home(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert flashinfer_support.nvcc_path() == str(tmp_path / "bin" / "nvcc")


def test_fmha_v2_skip_only_on_sm90(fake_flashinfer):
    fake_flashinfer.setattr(flashinfer_support, "nvcc_path", lambda: "/usr/bin/nvcc")
    route = get_route("fmha-v2")
    fake_flashinfer.setattr(fmha_v2, "device_sm", lambda device: 120)
    assert route.extra_reasons(_call()) == []  # dense on SM120 is fine
    (reason,) = route.extra_reasons(_call(skip=10.0))
    assert "SM90 only" in reason and "sm_120" in reason
    fake_flashinfer.setattr(fmha_v2, "device_sm", lambda device: 90)
    assert route.extra_reasons(_call(skip=10.0)) == []


def test_fmha_v2_refuses_unequal_query_and_key_counts(fake_flashinfer):
    """FlashInfer 0.7.4's kernel got such sequences wrong on the H200 (rel-L1 0.2-0.3, or NaNs)."""
    fake_flashinfer.setattr(flashinfer_support, "nvcc_path", lambda: "/usr/bin/nvcc")
    fake_flashinfer.setattr(fmha_v2, "device_sm", lambda device: 90)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    for q_lens, kv_lens, refused in (([100, 50], [100, 80], True), ([100, 80], [100, 50], True), ([64, 9], [64, 9], False)):
        layout = PackedLayout.from_cu_seqlens(
            cu(q_lens), cu(kv_lens), max(q_lens), max(kv_lens), q_tokens=sum(q_lens), kv_tokens=sum(kv_lens)
        )
        q = torch.zeros(sum(q_lens), 2, 128, dtype=torch.bfloat16)
        kv = torch.zeros(sum(kv_lens), 2, 128, dtype=torch.bfloat16)
        reasons = get_route("fmha-v2").extra_reasons(AttentionCall(q, kv, kv, layout, 0.1))
        assert bool(reasons) == refused
        if refused:
            assert "unequal query and key counts" in reasons[0] and "[1]" in reasons[0]


def test_fmha_v2_module_uri_matches_flashinfer_naming():
    assert fmha_v2.module_uri(torch.bfloat16) == "trtllm_fmha_v2_separate_q_k_v_bf16_bf16"
    assert fmha_v2.module_uri(torch.float16) == "trtllm_fmha_v2_separate_q_k_v_fp16_fp16"


def test_dense_order_on_sm90_follows_the_measured_table(monkeypatch):
    monkeypatch.setattr(order, "device_sm", lambda device: 90)
    for (dim, bucket), measured in order.SM90_DENSE_ORDER.items():
        tokens = {"text": 512, "short": 4096, "long": order.LONG_KV + 64}[bucket]
        ranked = ranked_routes(_call(dim=dim, tokens=tokens))
        assert tuple(ranked[:len(measured)]) == measured and "reference" not in ranked
    # Skip-softmax without SAGE on SM90 goes to gluon, then fmha-v2, ahead of every other route.
    assert ranked_routes(_call(skip=10.0))[:2] == ["gluon", "fmha-v2"]


def test_dense_order_off_hopper_keeps_registration_order_with_triton_after_sdpa():
    call = _call()  # CPU: no SM
    ranked = ranked_routes(call)
    # (sage-sm90 runs int8 SAGE only, so it is in no dense list.)
    assert [n for n in ranked if n != "triton"] == [n for n in route_names() if n not in ("triton", "reference", "sage-sm90")]
    # The Triton kernel's dense path is the fallback: cuDNN / FlashAttention-2 through sdpa come first.
    assert ranked.index("sdpa") < ranked.index("triton") and "reference" not in ranked
    skip = ranked_routes(_call(skip=10.0))
    assert skip.index("triton") < skip.index("sdpa")
    assert select_route(call).name == "sdpa"


def test_workspace_is_shared_and_zeroed():
    a = flashinfer_support.flashinfer_workspace("cpu", min_bytes=1024)
    b = flashinfer_support.flashinfer_workspace(torch.device("cpu"))
    assert a is b and a.dtype == torch.uint8 and int(a.count_nonzero()) == 0
    big = flashinfer_support.flashinfer_workspace("cpu", min_bytes=a.numel() + 1)
    assert big.numel() > a.numel() and flashinfer_support.flashinfer_workspace("cpu") is big
    flashinfer_support._workspaces.clear()


def test_announce_jit_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(flashinfer_support, "jit_built", lambda uri: False)
    with caplog.at_level("WARNING", logger="diffusers_trtllm"):
        flashinfer_support.announce_jit("some_module_for_test")
        flashinfer_support.announce_jit("some_module_for_test")
    messages = [r.getMessage() for r in caplog.records if "some_module_for_test" in r.getMessage()]
    assert len(messages) == 1 and "about 80 s, once" in messages[0]


def test_fa3_returns_flashinfer_lse_in_natural_log(monkeypatch):
    """FlashInfer's contract, faked on the CPU: ``return_lse=True`` gives ``(out, lse)`` with ``lse``
    ``[tokens, heads]`` in log2 units; the route hands ring attention the natural log (the reference's)."""
    from diffusers_trtllm.kernels.reference import reference_attention

    def attend(q, k, v, layout, scale, return_lse):
        res = reference_attention(q, k, v, layout.cu_seqlens_q, layout.cu_seqlens_kv, layout.q_lens, layout.kv_lens,
                                  softmax_scale=scale)
        return (res.out, res.lse / math.log(2.0)) if return_lse else res.out

    gen = torch.Generator().manual_seed(0)
    for layout in (PackedLayout.dense(1, 40, 50, "cpu"), PackedLayout.dense(2, 40, 50, "cpu")):
        q = torch.randn(layout.total_q, 2, 64, generator=gen)
        k, v = torch.randn(2, layout.total_kv, 2, 64, generator=gen)

        def single(q, k, v, *, causal, kv_layout, sm_scale, backend, return_lse=False):
            assert (causal, kv_layout, backend) == (False, "NHD", "fa3")
            return attend(q, k, v, layout, sm_scale, return_lse)

        class Ragged:
            def run(self, q, k, v, return_lse=False):
                return attend(q, k, v, layout, 0.125, return_lse)

        monkeypatch.setattr(flashinfer_support, "flashinfer_or_none", lambda: types.SimpleNamespace(
            single_prefill_with_kv_cache=single))
        monkeypatch.setattr(flashinfer_support, "announce_jit", lambda *a, **kw: None)
        monkeypatch.setattr(fa3, "module_uri", lambda call: "fa3_module")
        monkeypatch.setattr(fa3, "_ragged_wrapper", lambda call: Ragged())
        route = get_route("fa3")
        for return_lse in (False, True):
            call = AttentionCall(q, k, v, layout, 0.125, return_lse=return_lse)
            result = route.run(call)
            expected = reference_attention(q, k, v, layout.cu_seqlens_q, layout.cu_seqlens_kv, layout.q_lens,
                                           layout.kv_lens, softmax_scale=0.125)
            torch.testing.assert_close(result.out, expected.out)
            if return_lse:
                torch.testing.assert_close(result.lse, expected.lse, rtol=1e-5, atol=1e-5)
            else:
                assert result.lse is None


def _ragged_call(lens=(96, 40), heads=2, dim=64, scale=0.1, **kw) -> AttentionCall:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lens), heads, dim, generator=gen).to(torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    layout = PackedLayout.from_cu_seqlens(cu, cu, max(lens), max(lens), q_tokens=sum(lens), kv_tokens=sum(lens))
    return AttentionCall(q, k, v, layout, scale, **kw)


def test_fmha_v2_lse_from_softmax_stats(monkeypatch):
    """FlashInfer's contract, faked (``fake_fmha_v2``): stats only when asked, and then in ``CONTIGUOUS_Q_KV``
    (``SEPARATE_Q_K_V`` would end the process); row max / sqrt(d) and row sum become the reference's LSE.
    The scale is not 1/sqrt(d), so the conversion's ``bmm1_scale * sqrt(d)`` matters."""
    from diffusers_trtllm.kernels.reference import reference_attention

    calls: list = []
    fi = types.SimpleNamespace(prefill=types.SimpleNamespace(trtllm_fmha_v2_prefill=fake_trtllm_fmha_v2_prefill(calls)))
    monkeypatch.setattr(flashinfer_support, "_import", lambda: (fi, None))
    monkeypatch.setattr(flashinfer_support, "jit_built", lambda uri: True)
    for return_lse in (False, True):
        call = _ragged_call(return_lse=return_lse)
        result = get_route("fmha-v2").run(call)
        (args,) = calls[-1:]
        assert args["layout"] == ("CONTIGUOUS_Q_KV" if return_lse else "SEPARATE_Q_K_V")
        assert args["stats"] is return_lse and args["bmm1_scale"] == 0.1
        layout = call.layout
        expected = reference_attention(call.q.float(), call.k.float(), call.v.float(), layout.cu_seqlens_q,
                                       layout.cu_seqlens_kv, layout.q_lens, layout.kv_lens, softmax_scale=0.1)
        torch.testing.assert_close(result.out.float(), expected.out.float(), rtol=1e-2, atol=1e-2)
        if return_lse:
            assert result.lse.shape == call.q.shape[:2] and result.lse.dtype == torch.float32
            torch.testing.assert_close(result.lse, expected.lse, rtol=1e-5, atol=1e-4)
        else:
            assert result.lse is None


def test_fmha_v2_lse_needs_sm90_and_the_contiguous_module(fake_flashinfer):
    route = get_route("fmha-v2")
    lse = _ragged_call(return_lse=True, kv_shards=2)
    fake_flashinfer.setattr(flashinfer_support, "nvcc_path", lambda: None)
    fake_flashinfer.setattr(flashinfer_support, "jit_built", lambda uri: uri == fmha_v2.module_uri(torch.bfloat16))
    fake_flashinfer.setattr(fmha_v2, "device_sm", lambda device: 90)
    assert route.extra_reasons(_ragged_call()) == []
    (reason,) = route.extra_reasons(lse)
    assert "trtllm_fmha_v2_contiguous_q_kv_bf16_bf16" in reason
    fake_flashinfer.setattr(flashinfer_support, "jit_built", lambda uri: True)
    assert route.extra_reasons(lse) == []
    fake_flashinfer.setattr(fmha_v2, "device_sm", lambda device: 120)
    (reason,) = route.extra_reasons(lse)
    assert "softmax stats" in reason and "sm_120" in reason


@pytest.mark.parametrize("quant", [None, "fp8_e4m3"])
def test_ring_skip_calls_choose_the_fmha_v2_routes_on_sm90(fake_flashinfer, quant):
    """``backend="auto"`` on SM90 (faked; the CPU tensors count as the GPU's): a ring KV shard (``return_lse``)
    with skip-softmax goes to fmha-v2, and with fp8 SAGE to fmha-v2-fp8, as on one GPU. Skip alone on
    one GPU runs the gluon kernel, which returns no log-sum-exp, so the ring shard takes fmha-v2."""
    from diffusers_trtllm.config import QuantConfig
    from diffusers_trtllm.kernels import fmha_v2_fp8, gluon_attn
    from diffusers_trtllm.routing.registry import capability_reasons

    fake_flashinfer.setattr(flashinfer_support, "jit_built", lambda uri: True)
    for module in (fmha_v2, order, gluon_attn):
        fake_flashinfer.setattr(module, "device_sm", lambda device: 90)

    def auto_choice(call):
        def reasons(route):
            on_cpu = replace(route.caps, device_types=frozenset({"cpu"}))
            return capability_reasons(on_cpu, call) or route.extra_reasons(call)

        return next(name for name in ranked_routes(call) if not reasons(get_route(name)))

    one = _call(skip=10.0)
    if quant is not None:
        one = replace(one, quant=QuantConfig(dtype_qk=quant))
    ring = replace(one, return_lse=True, kv_shards=2)
    if quant is None:
        assert auto_choice(ring) == "fmha-v2"
        assert auto_choice(one) == ("gluon" if gluon_attn.gluon_missing() is None else "fmha-v2")
    else:
        assert auto_choice(one) == auto_choice(ring) == "fmha-v2-fp8"
