"""The ``gluon`` route (issue 12) on an H200: dense, skip-softmax and int8 SAGE against the reference,
over the ragged batches of the ``triton`` route's GPU tests (same inputs, same tolerances)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import rel_l1, requires_cuda
from diffusers_trtllm.config import QuantConfig
from test_triton_attn_gpu import (MAGNITUDES, NONFINITE, ROUTES, _inputs, _reference, check_extreme_magnitudes,
                                  check_nonfinite_propagation)

pytestmark = [pytest.mark.gpu, requires_cuda]


@pytest.fixture(autouse=True)
def _hopper_with_gluon():
    from diffusers_trtllm.kernels.gluon_attn import gluon_missing

    if gluon_missing():
        pytest.skip(gluon_missing())
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the gluon kernel is written for sm_90")


#: Schedules and knobs under test: name -> overrides of ``GluonConfig()`` (two consumers, 2 stages, in order).
#: The tuned defaults (``gluon_attn._TUNED``) are among the first three, which every test runs.
CONFIGS = {
    "inorder": {},
    "three_stages": dict(stages=3),
    "fa3_three_stages": dict(schedule="fa3", stages=3),
    "fa3": dict(schedule="fa3"),
    "fa3_one_consumer": dict(schedule="fa3", consumers=1, maxnreg=240),
    "lookahead": dict(schedule="lookahead"),
    "one_consumer": dict(consumers=1),
}


def _config(name):
    from dataclasses import replace

    from diffusers_trtllm.kernels.gluon_attn import GluonConfig

    return replace(GluonConfig(), **CONFIGS[name])


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dim,kv_heads", [(64, 8), (128, 2), (128, 8)])
def test_dense_matches_reference(dim, kv_heads, config):
    from diffusers_trtllm.kernels.gluon_attn import gluon_attention

    q, k, v, layout = _inputs(dim, kv_heads=kv_heads)
    out = gluon_attention(q, k, v, layout, softmax_scale=dim**-0.5, config=_config(config)).out
    assert rel_l1(out, _reference(q, k, v, layout).out) < 1e-2


@pytest.mark.parametrize("config", list(CONFIGS)[:4])
@pytest.mark.parametrize("dim", [64, 128])
def test_skip_counts_match_reference(dim, config):
    from diffusers_trtllm.kernels.gluon_attn import gluon_attention

    q, k, v, layout = _inputs(dim, kv_heads=4)
    cfg = _config(config)
    factor = 0.02 * layout.max_seqlen_kv
    res = gluon_attention(q, k, v, layout, softmax_scale=dim**-0.5, skip_factor=factor, collect_stats=True, config=cfg)
    ref = _reference(q, k, v, layout, skip_factor=factor, tile_q=cfg.block_m, tile_kv=cfg.block_n)
    assert res.total_tiles == ref.total_tiles
    assert ref.skipped_tiles > 0.1 * ref.total_tiles  # the inputs do exercise the rule
    # Borderline tiles may flip (exp2 vs exp, fp32 rounding): allow a handful.
    assert abs(res.skipped_tiles - ref.skipped_tiles) <= max(2, ref.total_tiles // 500)
    assert rel_l1(res.out, ref.out) < 1e-2
    none = gluon_attention(q, k, v, layout, softmax_scale=dim**-0.5, skip_factor=0.0, collect_stats=True, config=cfg)
    assert none.skipped_tiles == 0


@pytest.mark.parametrize("config", list(CONFIGS)[:3])
@pytest.mark.parametrize("skip", [None, 0.02])
@pytest.mark.parametrize("dim", [64, 128])
def test_int8_sage_matches_reference(dim, skip, config):
    from diffusers_trtllm.kernels.gluon_attn import gluon_attention

    q, k, v, layout = _inputs(dim, kv_heads=4)
    quant = QuantConfig("int8", 1, 16)
    cfg = _config(config)
    factor = None if skip is None else skip * layout.max_seqlen_kv
    res = gluon_attention(q, k, v, layout, softmax_scale=dim**-0.5, skip_factor=factor, quant=quant,
                          collect_stats=True, config=cfg)
    ref = _reference(q, k, v, layout, skip_factor=factor, quant=quant, tile_q=cfg.block_m, tile_kv=cfg.block_n)
    assert res.total_tiles == ref.total_tiles
    if skip is None:
        assert res.skipped_tiles == 0
    else:
        assert ref.skipped_tiles > 0.1 * ref.total_tiles
        assert abs(res.skipped_tiles - ref.skipped_tiles) <= max(2, ref.total_tiles // 500)
    assert rel_l1(res.out, ref.out) < 1.5e-2
    assert rel_l1(res.out, _reference(q, k, v, layout).out) < 0.06


#: The triton tests' extremes that the gluon kernel takes: bf16 inputs, int8 SAGE.
GLUON_ROUTES = [(qk, skip) for qk, skip in ROUTES if qk != "fp8_e4m3"]


@pytest.mark.parametrize("dtype_qk,skip", GLUON_ROUTES)
@pytest.mark.parametrize("magnitude", [m for dtype, m in MAGNITUDES if dtype == torch.bfloat16])
def test_extreme_magnitudes_stay_finite(magnitude, dtype_qk, skip):
    from diffusers_trtllm.kernels.gluon_attn import gluon_attention

    check_extreme_magnitudes(gluon_attention, 64, torch.bfloat16, magnitude, dtype_qk, skip)


@pytest.mark.parametrize("dtype_qk,skip", GLUON_ROUTES)
@pytest.mark.parametrize("tensor,value", NONFINITE)
def test_nonfinite_inputs_propagate(tensor, value, dtype_qk, skip):
    from diffusers_trtllm.kernels.gluon_attn import gluon_attention

    check_nonfinite_propagation(gluon_attention, 64, tensor, value, dtype_qk, skip)


def test_auto_takes_it_for_skip_alone_only():
    """On the H200 ``auto`` runs skip-softmax alone on gluon; dense work goes to fa3/cuDNN and int8 SAGE to triton."""
    from diffusers_trtllm.routing import AttentionCall, select_route

    q, k, v, layout = _inputs(128)
    dense = AttentionCall(q, k, v, layout, softmax_scale=128**-0.5)
    skip = dataclasses.replace(dense, skip_factor=1.0)
    assert select_route(skip).name == "gluon"
    assert select_route(dense).name != "gluon"
    assert select_route(dataclasses.replace(skip, quant=QuantConfig("int8"))).name == "triton"
    res = select_route(skip).run(skip)
    assert res.route == "gluon" and torch.isfinite(res.out.float()).all()
