"""Contract of the trtllm-gen route (Blackwell only, not run on hardware here).

FlashInfer's two functions are replaced by fakes with FlashInfer 0.7.4's exact
signatures that check every argument they receive and compute with the reference,
in FlashInfer's scale layout. The route's output must then equal the reference.
"""

from dataclasses import replace
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from diffusers_trtllm import QuantConfig, SkipSoftmaxConfig, run_attention
from diffusers_trtllm.kernels import flashinfer_support, trtllm_gen
from diffusers_trtllm.kernels.reference import SageTensors, block_ids, reference_attention, sage_quantize
from diffusers_trtllm.layout import PackedLayout
from diffusers_trtllm.routing.registry import AttentionCall


class FakeFlashInfer:
    """Stands in for the ``flashinfer`` module: records calls, checks arguments, computes with the reference."""

    def __init__(self, layout: PackedLayout):
        self.layout = layout
        self.quantize_calls: list[dict] = []
        self.attention_calls: list[dict] = []
        self.prefill = SimpleNamespace(trtllm_ragged_attention_deepseek=self.trtllm_ragged_attention_deepseek)

    def _check_cu(self, cu_q, cu_kv):
        for cu, expected in ((cu_q, self.layout.cu_seqlens_q), (cu_kv, self.layout.cu_seqlens_kv)):
            assert cu.dtype == torch.int32 and cu.is_contiguous() and cu.ndim == 1
            assert torch.equal(cu, expected)

    def trtllm_sage_attention_quantize(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        q_block_size: int = 1,
        k_block_size: int = 16,
        qk_quant_dtype: torch.dtype = torch.int8,
        cum_seq_lens_q: Optional[torch.Tensor] = None,
        cum_seq_lens_kv: Optional[torch.Tensor] = None,
        smooth_k: bool = False,
    ):
        self.quantize_calls.append(dict(q_block_size=q_block_size, k_block_size=k_block_size, qk_quant_dtype=qk_quant_dtype, smooth_k=smooth_k))
        for t in (query, key, value):
            assert t.dtype in (torch.float16, torch.bfloat16) and t.ndim == 3 and t.is_contiguous()
        assert key.shape[:2] == value.shape[:2] and query.shape[2] == key.shape[2]
        assert q_block_size in (1, 4, 16) and k_block_size in (1, 4, 16)
        assert qk_quant_dtype in (torch.int8, torch.float8_e4m3fn)
        self._check_cu(cum_seq_lens_q, cum_seq_lens_kv)
        dtype_qk = "int8" if qk_quant_dtype == torch.int8 else "fp8_e4m3"
        cfg = QuantConfig(dtype_qk, q_block_size, k_block_size, smooth_k)
        s = sage_quantize(query, key, value, cum_seq_lens_q, cum_seq_lens_kv, self.layout.q_lens, self.layout.kv_lens, cfg)
        # FlashInfer's shapes: [heads, ceil(tokens / block) + batch - 1], V per (head, channel).
        batch = cum_seq_lens_q.numel() - 1
        assert s.q_scale.shape == (query.shape[1], -(-query.shape[0] // q_block_size) + batch - 1)
        assert s.k_scale.shape == (key.shape[1], -(-key.shape[0] // k_block_size) + batch - 1)
        out = (s.q, s.k, s.v, s.q_scale, s.k_scale, s.v_scale)
        return out + (key.float().mean(0),) if smooth_k else out

    def trtllm_ragged_attention_deepseek(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        workspace_buffer: torch.Tensor,
        seq_lens: torch.Tensor,
        max_q_len: int,
        max_kv_len: int,
        bmm1_scale,
        bmm2_scale,
        o_sf_scale: float,
        batch_size: int,
        window_left: int,
        cum_seq_lens_q: torch.Tensor,
        cum_seq_lens_kv: torch.Tensor,
        enable_pdl,
        is_causal: bool,
        return_lse: bool,
        attention_sinks: Optional[torch.Tensor] = None,
        skip_softmax_threshold_scale_factor: Optional[float] = None,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        sage_attn_sfs=(None, None, None, None),
        num_elts_per_sage_attn_blk=(0, 0, 0, 0),
        backend: str = "trtllm-gen",
        q_seq_lens_cpu: Optional[torch.Tensor] = None,
        kv_seq_lens_cpu: Optional[torch.Tensor] = None,
        use_fp16_softmax: Optional[bool] = None,
        uses_spcompress: Optional[bool] = None,
        skip_all_rows_active_check: bool = True,
    ):
        layout = self.layout
        self.attention_calls.append(
            dict(
                skip=skip_softmax_threshold_scale_factor,
                sage=num_elts_per_sage_attn_blk,
                skip_all_rows_active_check=skip_all_rows_active_check,
                q_seq_lens_cpu=q_seq_lens_cpu,
                dtype=query.dtype,
            )
        )
        assert workspace_buffer.dtype == torch.uint8
        assert seq_lens.dtype == torch.int32 and seq_lens.tolist() == list(layout.kv_lens)
        assert type(max_q_len) is int and max_q_len == layout.max_seqlen_q
        assert type(max_kv_len) is int and max_kv_len == layout.max_seqlen_kv
        assert bmm2_scale == 1.0 and o_sf_scale == -1.0 and window_left == -1
        assert batch_size == layout.num_seqs and enable_pdl is False and is_causal is False and return_lse is False
        assert attention_sinks is None and out is None and backend == "trtllm-gen"
        self._check_cu(cum_seq_lens_q, cum_seq_lens_kv)
        assert query.shape[0] == layout.total_q and key.shape[0] == value.shape[0] == layout.total_kv
        lens = dict(q_lens=layout.q_lens, kv_lens=layout.kv_lens)
        if min(layout.q_lens) > 0:
            assert skip_all_rows_active_check is True and q_seq_lens_cpu is None
        else:
            assert q_seq_lens_cpu.device.type == "cpu" and q_seq_lens_cpu.tolist() == list(layout.q_lens)
            assert kv_seq_lens_cpu.tolist() == list(layout.kv_lens)
        args = dict(softmax_scale=bmm1_scale, skip_factor=skip_softmax_threshold_scale_factor)
        if sage_attn_sfs[0] is None:
            assert num_elts_per_sage_attn_blk == (0, 0, 0, 0)
            assert query.dtype in (torch.float16, torch.bfloat16)
            return reference_attention(query, key, value, cum_seq_lens_q, cum_seq_lens_kv, **lens, **args).out
        q_scale, k_scale, p_scale, v_scale = sage_attn_sfs
        qb, kb, pb, vb = num_elts_per_sage_attn_blk
        assert p_scale is None and pb == 0 and vb == 1
        assert query.dtype == key.dtype and query.dtype in (torch.int8, torch.float8_e4m3fn)
        assert value.dtype == torch.float8_e4m3fn and v_scale.shape == (value.shape[1], value.shape[2])
        assert q_scale.dtype == k_scale.dtype == v_scale.dtype == torch.float32
        q_ids, _ = block_ids(cum_seq_lens_q, layout.q_lens, qb)
        k_ids, _ = block_ids(cum_seq_lens_kv, layout.kv_lens, kb)
        sage = SageTensors(query, key, value, q_scale, k_scale, v_scale, q_ids, k_ids)
        return reference_attention(query, key, value, cum_seq_lens_q, cum_seq_lens_kv, **lens, **args, sage=sage).out


@pytest.fixture
def fake(monkeypatch):
    """Install a fake FlashInfer for a layout; let the route run on the CPU as if on an SM100 GPU."""

    def install(layout):
        fi = FakeFlashInfer(layout)
        monkeypatch.setattr(flashinfer_support, "flashinfer_or_none", lambda: fi)
        monkeypatch.setattr(flashinfer_support, "flashinfer_missing_reason", lambda: None)
        monkeypatch.setattr(flashinfer_support, "flashinfer_workspace", lambda device: torch.zeros(64, dtype=torch.uint8))
        monkeypatch.setattr(trtllm_gen, "device_sm", lambda device: 100)
        caps = replace(trtllm_gen.TrtllmGenRoute.caps, device_types=frozenset({"cpu", "cuda"}), sms=None)
        monkeypatch.setattr(trtllm_gen.TrtllmGenRoute, "caps", caps)
        return fi

    return install


def _inputs(batch=2, length=160, heads=2, dim=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, length, heads, dim, generator=g).to(torch.bfloat16) for _ in range(3)]


def _expected(q, k, v, layout, **kwargs):
    return reference_attention(
        layout.pack_q(q),
        layout.pack_kv(k),
        layout.pack_kv(v),
        layout.cu_seqlens_q,
        layout.cu_seqlens_kv,
        layout.q_lens,
        layout.kv_lens,
        softmax_scale=128**-0.5,
        **kwargs,
    ).out


@pytest.mark.parametrize("dtype_qk", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("q_block, k_block, smooth_k", [(1, 16, False), (4, 4, True), (16, 1, False)])
@pytest.mark.parametrize("threshold", [None, 0.05])
def test_sage_and_skip_arguments_and_output(fake, dtype_qk, q_block, k_block, smooth_k, threshold):
    q, k, v = _inputs()
    mask = torch.ones(2, 160, dtype=torch.bool)
    mask[0, 40:70] = False  # padding in the middle of the first sequence
    layout = PackedLayout.from_masks(2, 160, 160, kv_mask=mask)
    fi = fake(layout)
    quant = QuantConfig(dtype_qk, q_block, k_block, smooth_k)
    skip = SkipSoftmaxConfig(threshold=threshold) if threshold is not None else None
    out, result = run_attention(q, k, v, attn_mask=mask, quant=quant, skip=skip, backend="trtllm-gen")
    assert result.route == "trtllm-gen" and out.dtype == torch.bfloat16
    (qcall,) = fi.quantize_calls
    assert qcall == dict(q_block_size=q_block, k_block_size=k_block, qk_quant_dtype=quant.qk_dtype, smooth_k=smooth_k)
    (acall,) = fi.attention_calls
    assert acall["sage"] == (q_block, k_block, 0, 1) and acall["dtype"] == quant.qk_dtype
    assert acall["skip"] == (None if threshold is None else pytest.approx(threshold * 160))
    factor = None if threshold is None else threshold * 160
    expected = layout.unpack_q(_expected(q, k, v, layout, quant=quant, skip_factor=factor))
    assert torch.equal(out, expected)


def test_dense_call(fake):
    q, k, v = _inputs()
    layout = PackedLayout.dense(2, 160, 160, "cpu")
    fi = fake(layout)
    out, result = run_attention(q, k, v, backend="trtllm-gen")
    (acall,) = fi.attention_calls
    assert acall["sage"] == (0, 0, 0, 0) and acall["skip"] is None and acall["dtype"] == torch.bfloat16
    assert not fi.quantize_calls
    assert torch.equal(out, layout.unpack_q(_expected(q, k, v, layout)))


def test_short_kv_sequence_runs_dense_with_one_warning(fake, caplog):
    q, k, v = _inputs()
    mask = torch.ones(2, 160, dtype=torch.bool)
    mask[1, 10:] = False  # second sequence keeps 10 keys < k_block_size 16
    fi = fake(PackedLayout.from_masks(2, 160, 160, kv_mask=mask))
    with caplog.at_level("WARNING", logger="diffusers_trtllm"):
        for _ in range(2):
            run_attention(q, k, v, attn_mask=mask, quant={"dtype_qk": "int8"}, backend="trtllm-gen", role="cross-short")
    assert [c["sage"] for c in fi.attention_calls] == [(0, 0, 0, 0)] * 2 and not fi.quantize_calls
    warnings = [r for r in caplog.records if "k_block_size=16" in r.getMessage()]
    assert len(warnings) == 1 and "'cross-short'" in warnings[0].getMessage()


def test_sequence_without_queries_hands_host_lengths(fake):
    q, k, v = _inputs()
    layout = PackedLayout.from_masks(
        2, 160, 160, q_mask=torch.tensor([[True] * 160, [False] * 160]), kv_mask=torch.ones(2, 160, dtype=torch.bool)
    )
    fi = fake(layout)
    call = AttentionCall(layout.pack_q(q), layout.pack_kv(k), layout.pack_kv(v), layout, 128**-0.5)
    result = trtllm_gen.TrtllmGenRoute().run(call)
    assert fi.attention_calls[0]["skip_all_rows_active_check"] is True  # the default; mirrors take precedence
    assert fi.attention_calls[0]["q_seq_lens_cpu"].tolist() == [160, 0]
    assert result.out.shape == (160, 2, 128)


def _call(device_type="cpu", dim=128, quant=None, skip=None, dtype=torch.bfloat16, kv_heads=2):
    q = torch.zeros(16, 2, dim, dtype=dtype)
    k = torch.zeros(16, kv_heads, dim, dtype=dtype)
    return AttentionCall(q, k, k, PackedLayout.dense(1, 16, 16, "cpu"), 0.1, skip_factor=skip, quant=quant)


def test_reasons_without_flashinfer_or_blackwell(monkeypatch):
    route = trtllm_gen.TrtllmGenRoute()
    assert any("runs on ['cuda'], not cpu" in r for r in route.not_supported_reasons(_call()))
    monkeypatch.setattr(trtllm_gen.TrtllmGenRoute, "caps", replace(route.caps, device_types=frozenset({"cpu"})))
    monkeypatch.setattr(flashinfer_support, "flashinfer_missing_reason", lambda: "flashinfer is not installed")
    assert route.not_supported_reasons(_call()) == ["flashinfer is not installed"]
    reasons = route.not_supported_reasons(_call(dim=64, dtype=torch.float32, kv_heads=1))
    assert any("head dim 64" in r for r in reasons) and any("float32" in r for r in reasons)
    assert any("grouped-query" in r for r in reasons)


def test_reasons_for_sage_support(monkeypatch, fake):
    fi = fake(PackedLayout.dense(1, 16, 16, "cpu"))
    route = trtllm_gen.TrtllmGenRoute()
    int8 = QuantConfig("int8")
    assert route.not_supported_reasons(_call(quant=int8)) == []
    monkeypatch.setattr(trtllm_gen, "device_sm", lambda device: 103)
    assert "int8 SAGE needs SM in [100]" in route.not_supported_reasons(_call(quant=int8))[0]
    assert route.not_supported_reasons(_call(quant=QuantConfig("fp8_e4m3"))) == []
    assert route.not_supported_reasons(_call(quant=QuantConfig("fp8_e4m3", 1, 128))) == [
        "FlashInfer's SAGE kernels take k_block_size in (1, 4, 16), not 128"]
    old_build = SimpleNamespace(prefill=SimpleNamespace(trtllm_ragged_attention_deepseek=lambda query, key: None))
    monkeypatch.setattr(flashinfer_support, "flashinfer_or_none", lambda: old_build)
    assert "no SAGE kernels" in route.not_supported_reasons(_call(quant=QuantConfig("fp8_e4m3")))[0]
    assert route.not_supported_reasons(_call(skip=1.0)) == []
    del fi
