"""The ``gluon`` route without a GPU: every kernel variant compiles for sm_90 ahead of time (Hopper
tensor-core and register-reallocation instructions in its PTX), and where ``auto`` ranks the route."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from diffusers_trtllm.kernels import gluon_attn

needs_gluon = pytest.mark.skipif(gluon_attn.gluon_missing() is not None, reason=str(gluon_attn.gluon_missing()))

#: wgmma flavours each variant must contain: (Q K^T, P V).
WGMMA = {
    "dense": ("f32.bf16.bf16", "f32.bf16.bf16"),
    "skip": ("f32.bf16.bf16", "f32.bf16.bf16"),
    "int8": ("s32.s8.s8", "f32.e4m3.e4m3"),
    "int8_skip": ("s32.s8.s8", "f32.e4m3.e4m3"),
}


def _compile(variant, head_dim, schedule):
    from dataclasses import replace

    config = replace(gluon_attn.default_config(variant), schedule=schedule)
    try:
        return gluon_attn.compile_sm90(variant, head_dim, config)
    except Exception as exc:  # a Triton without the sm_90 backend, not a kernel bug
        if "backend" in str(exc).lower() and "cuda" in str(exc).lower():
            pytest.skip(f"this Triton cannot compile for sm_90: {exc}")
        raise


#: Every variant in order at head dim 128, the other schedules and head dim 64 on some (~1.5 s each, cold).
CASES = [(v, 128, "inorder") for v in sorted(WGMMA)] + [
    ("dense", 128, "fa3"), ("int8_skip", 128, "fa3"), ("skip", 128, "lookahead"), ("skip", 64, "inorder"),
    ("int8", 64, "fa3")]


@needs_gluon
@pytest.mark.parametrize("variant,head_dim,schedule", CASES)
def test_compiles_for_sm90_with_wgmma(variant, head_dim, schedule):
    kernel = _compile(variant, head_dim, schedule)
    ptx = kernel.asm["ptx"]
    kinds = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k\d+\.(\S+?)[ ;]", ptx))
    for kind in WGMMA[variant]:
        assert kind in kinds, f"{variant}: no {kind} wgmma in the PTX (found {sorted(kinds)})"
    assert "setmaxnreg" in ptx  # the warp-specialized partitions re-balance registers
    assert "cp.async.bulk.tensor" in ptx  # TMA loads
    assert kernel.metadata.shared <= 227 * 1024


def test_auto_takes_it_for_skip_alone_on_sm90_only(monkeypatch):
    """``auto`` ranks gluon first for skip-softmax without SAGE, behind the triton kernel otherwise;
    off sm_90 (here: the CPU) it says why it cannot serve."""
    from diffusers_trtllm.config import QuantConfig
    from diffusers_trtllm.layout import PackedLayout
    from diffusers_trtllm.routing import AttentionCall, get_route, ranked_routes

    q = torch.randn(8, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    call = AttentionCall(q, q, q, PackedLayout.from_cu_seqlens(cu, cu, 8, 8, q_tokens=8, kv_tokens=8), softmax_scale=0.125)
    route = get_route("gluon")
    assert route.auto
    skip = dataclasses.replace(call, skip_factor=1.0)
    assert ranked_routes(skip)[0] == "gluon"
    for other in (call, dataclasses.replace(skip, quant=QuantConfig("int8"))):
        ranked = ranked_routes(other)
        assert ranked.index("triton") < ranked.index("gluon")
    assert route.not_supported_reasons(skip)  # no sm_90 GPU here
