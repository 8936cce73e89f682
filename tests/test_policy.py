"""CPU tests of the "never slower by default" policy: what it drops, where, and what the step table says."""

from __future__ import annotations

import pytest
import torch

import tiny_models
from diffusers_trtllm import SkipSoftmaxConfig, TrtllmAttnProcessor, run_attention
from diffusers_trtllm.routing import policy as policy_mod
from diffusers_trtllm.config import QuantConfig
from diffusers_trtllm.layout import PackedLayout
from diffusers_trtllm.routing.registry import AttentionCall, get_route

INT8 = QuantConfig(dtype_qk="int8")


def _call(kv: int, skip: float | None = 1.0, quant: QuantConfig | None = INT8) -> AttentionCall:
    q, k = torch.zeros(64, 1, 64), torch.zeros(kv, 1, 64)
    return AttentionCall(q, k, k, PackedLayout.dense(1, 64, kv, "cpu"), 0.1, skip_factor=skip, quant=quant)


@pytest.fixture
def on_gpu(monkeypatch):
    """Pretend the call runs on a GPU of the SM the test sets (the rules speak of GPU kernels)."""
    monkeypatch.setattr(policy_mod, "_measured_device", lambda device: True)

    def set_sm(sm: int) -> None:
        monkeypatch.setattr(policy_mod, "device_sm", lambda device: sm)

    set_sm(90)
    return set_sm


def test_short_kv_runs_without_skip_and_sage_on_sm90(on_gpu):
    decision = policy_mod.apply_policy(_call(512))
    assert decision.call.skip_factor is None and decision.call.quant is None
    assert "512 keys <= 1024" in decision.note and "SAGE off" in decision.note


def test_sage_needs_a_long_kv_on_sm90_only(on_gpu):
    fp8 = QuantConfig(dtype_qk="fp8_e4m3")
    image = policy_mod.apply_policy(_call(4608, quant=fp8), honour=("skip",))  # the SAGE rule alone
    assert image.call.skip_factor == 1.0 and image.call.quant is None and "4608 keys < 16384" in image.note
    video = policy_mod.apply_policy(_call(32760, quant=fp8))
    assert video.call.skip_factor == 1.0 and video.call.quant == fp8 and video.note is None
    # int8 SAGE where sage-sm90 cannot serve (here: no Hopper) runs on the Triton kernel, slower than fa3
    # dense at 480p: it pays from 65,536 keys
    wan480 = policy_mod.apply_policy(_call(32760))
    assert wan480.call.quant is None and "int8 SAGE (triton) is slower than fa3 dense" in wan480.note
    assert policy_mod.apply_policy(_call(75600)).call.quant == INT8
    on_gpu(100)  # not measured on Blackwell: SAGE stays; the short-KV skip rule holds everywhere
    blackwell = policy_mod.apply_policy(_call(512))
    assert blackwell.call.quant == INT8 and blackwell.call.skip_factor is None


def test_int8_sage_pays_from_8704_keys_on_the_cuda_kernel(on_gpu, monkeypatch):
    """Where sage-sm90 serves int8 SAGE it runs from 8,704 keys (served 1.054x cuDNN against fa3 dense's 1.023x on
    an H100, 1.050x / 0.983x on an H200; Flux 1536² 1.046x end to end), not at Flux 1024² (4,608 keys: 0.864x
    against 0.939x) nor from the Triton kernel's 65,536."""
    monkeypatch.setattr(policy_mod, "_int8_kernel", lambda call, backend: "sage-sm90")
    for kv in (8704, 9728, 16896, 32760):
        kept = policy_mod.apply_policy(_call(kv))
        assert kept.call.quant == INT8 and kept.note is None
    for kv in (4608, 8703):
        shorter = policy_mod.apply_policy(_call(kv), honour=("skip",))
        assert shorter.call.quant is None and f"{kv} keys < 8704" in shorter.note and "(sage-sm90)" in shorter.note


def test_int8_kernel_is_the_one_the_backend_would_run(monkeypatch):
    route = type(get_route("sage-sm90"))
    monkeypatch.setattr(route, "not_supported_reasons", lambda self, call: [])
    assert [policy_mod._int8_kernel(_call(32760), b) for b in ("auto", "sage-sm90", "triton")] == \
        ["sage-sm90", "sage-sm90", "triton"]
    monkeypatch.setattr(route, "not_supported_reasons", lambda self, call: ["needs nvcc"])
    assert policy_mod._int8_kernel(_call(32760), "auto") == "triton"


def test_ring_shards_divide_the_promised_sparsity_on_sm90(on_gpu):
    """A ring shard skips about 1/r of one process's tiles: skip alone needs target_sparsity / r >= 35%."""
    from dataclasses import replace

    alone = replace(_call(32760, quant=None), return_lse=True, kv_shards=2)
    assert policy_mod.apply_policy(alone, target_sparsity=0.8).call.skip_factor == 1.0  # 40% per shard
    dropped = policy_mod.apply_policy(alone, target_sparsity=0.6)  # 30% per shard
    assert dropped.call.skip_factor is None and "about 30% on each of 2 KV shards" in dropped.note
    assert policy_mod.apply_policy(replace(alone, kv_shards=1), target_sparsity=0.6).call.skip_factor == 1.0
    # SAGE's rules are per call (the shard's keys), as on one process; skip stays with SAGE.
    ring = policy_mod.apply_policy(replace(_call(75600), return_lse=True, kv_shards=2))
    assert ring.call.quant == INT8 and ring.call.skip_factor == 1.0


def test_always_and_cpu_honour_the_request(on_gpu):
    call = _call(512)
    assert policy_mod.apply_policy(call, "always").call is call
    with pytest.raises(ValueError, match="policy must be one of"):
        policy_mod.apply_policy(call, "never")
    kept = policy_mod.apply_policy(call, honour={"sage"})
    assert kept.call.quant == INT8 and kept.call.skip_factor is None and "skip-softmax off" in kept.note
    with pytest.raises(ValueError, match="honour takes"):
        policy_mod.apply_policy(call, honour={"quant"})


def test_cpu_calls_are_never_changed():
    call = _call(512)
    decision = policy_mod.apply_policy(call)
    assert decision.call is call and decision.note is None


def test_run_attention_reports_what_ran(on_gpu):
    q = torch.randn(1, 64, 2, 64)
    k = torch.randn(1, 512, 2, 64)
    _, result = run_attention(q, k, k, backend="reference")
    assert not result.sparse and not result.sage and result.note is None
    _, result = run_attention(q, k, k, skip=SkipSoftmaxConfig(threshold=0.1), quant=INT8, backend="reference")
    assert not result.sparse and not result.sage and "skip-softmax off" in result.note
    _, result = run_attention(q, k, k, skip=SkipSoftmaxConfig(threshold=0.1), backend="reference", policy="always")
    assert result.sparse and result.note is None


def test_processor_records_the_policy_and_honours_explicit_roles(on_gpu):
    model, inputs = tiny_models.build("flux")
    proc = TrtllmAttnProcessor(
        skip_softmax_threshold=0.1, backend="reference", roles={"joint": {"skip_softmax_threshold": 0.1}, "self": {"quant": None}}
    )
    model.set_attn_processor(proc)
    with torch.no_grad():
        model(**inputs)
    by_role = {}
    for state in proc.layers:
        for record in state.records:
            by_role.setdefault(state.role, []).append(record)
    assert all(r.sparse and r.note is None for r in by_role["joint"])  # explicit: honoured on 24 keys
    # "self" set only quant explicitly: its (inherited) skip request still follows the rules
    assert all(not r.sparse and "skip-softmax off" in r.note for r in by_role["self"])
    assert "skip-softmax off" in proc.format_step_table()
    with pytest.raises(ValueError, match="policy must be one of"):
        TrtllmAttnProcessor(policy="sometimes")


def test_skip_alone_needs_a_promised_sparsity_on_sm90(on_gpu):
    bare = policy_mod.apply_policy(_call(32760, quant=None))
    assert bare.call.skip_factor is None and "slower than fa3 dense below 35%" in bare.note and "bare threshold" in bare.note
    low = policy_mod.apply_policy(_call(32760, quant=None), target_sparsity=0.2)
    assert low.call.skip_factor is None and "target_sparsity 0.2" in low.note
    high = policy_mod.apply_policy(_call(32760, quant=None), target_sparsity=0.5)
    assert high.call.skip_factor == 1.0 and high.note is None
    kept = policy_mod.apply_policy(_call(32760, quant=None), honour=("skip",))
    assert kept.call.skip_factor == 1.0
    fp8 = QuantConfig(dtype_qk="fp8_e4m3")
    with_sage = policy_mod.apply_policy(_call(32760, quant=fp8))  # skip beside SAGE stays
    assert with_sage.call.skip_factor == 1.0 and with_sage.call.quant == fp8
    int8_480p = policy_mod.apply_policy(_call(32760))  # int8 dropped first, then skip alone
    assert int8_480p.call.quant is None and int8_480p.call.skip_factor is None
    on_gpu(100)
    assert policy_mod.apply_policy(_call(32760, quant=None)).call.skip_factor == 1.0


def test_skip_alone_needs_a_long_kv_on_sm90(on_gpu):
    """Flux's 4,608 keys: skip alone gained nothing at 50% skipped on the H200, so even a promised 70% runs dense."""
    flux = policy_mod.apply_policy(_call(4608, quant=None), target_sparsity=0.7)
    assert flux.call.skip_factor is None and "4608 keys < 16384" in flux.note and "35%" not in flux.note
    wan = policy_mod.apply_policy(_call(32760, quant=None), target_sparsity=0.7)
    assert wan.call.skip_factor == 1.0 and wan.note is None
    assert policy_mod.apply_policy(_call(4608, quant=None), honour=("skip",)).call.skip_factor == 1.0
    fp8 = QuantConfig(dtype_qk="fp8_e4m3")
    assert policy_mod.apply_policy(_call(4608, quant=fp8), honour=("sage",)).call.skip_factor == 1.0  # beside SAGE
