"""A call of known shapes and settings reuses its decided plan (layout, policy, route), and only then."""

from __future__ import annotations

import importlib
from dataclasses import FrozenInstanceError, fields

import pytest
import torch
import torch.nn.functional as F

import tiny_models
from diffusers_trtllm import TrtllmAttnProcessor, install, run_attention
from diffusers_trtllm.config import QuantConfig
from diffusers_trtllm.layout import PackedLayout
from diffusers_trtllm.routing import registry
from diffusers_trtllm.serving import intercept
from diffusers_trtllm.serving.layer import Calibration, layer_of

attention_mod = importlib.import_module("diffusers_trtllm.attention")  # (the package exports a function of that name)


@pytest.fixture
def decisions(monkeypatch):
    """How many times a route was chosen (once per plan)."""
    count = [0]
    choose = attention_mod.select_route

    def counted(call, backend="auto"):
        count[0] += 1
        return choose(call, backend)

    monkeypatch.setattr(attention_mod, "select_route", counted)
    monkeypatch.setattr(attention_mod, "_PLANS", {})
    return count


def _qkv(tokens=32, heads=2, dim=64, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, tokens, heads, dim, generator=gen).to(dtype) for _ in range(3)]


def test_a_known_call_reuses_its_plan_and_computes_afresh(decisions):
    q, k, v = _qkv()
    first, res = run_attention(q, k, v, backend="reference")
    q2, k2, v2 = _qkv(seed=1)
    second, res2 = run_attention(q2, k2, v2, backend="reference")
    assert decisions[0] == 1 and res.route == res2.route == "reference"
    expected, _ = run_attention(q2, k2, v2, backend="reference", quant=None, skip={"threshold": None})  # a dict: no plan
    torch.testing.assert_close(second, expected)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("change", ["shape", "dtype", "scale", "quant", "skip", "timestep-gate", "stats", "layout"])
def test_any_change_decides_again(decisions, change):
    q, k, v = _qkv()
    layout = PackedLayout.dense(1, 32, 32, "cpu")
    base = dict(backend="reference", skip={"threshold": 0.1, "disabled_until_timestep": 0.5}, timestep=0.9,
                layout=layout)
    base["skip"] = attention_mod.SkipSoftmaxConfig.coerce(base["skip"])
    run_attention(q, k, v, **base)
    run_attention(q, k, v, **base)
    assert decisions[0] == 1
    kw = dict(base)
    if change == "shape":
        q, k, v = _qkv(tokens=48)
        kw["layout"] = PackedLayout.dense(1, 48, 48, "cpu")
    elif change == "dtype":
        q, k, v = (x.half() for x in (q, k, v))
    elif change == "scale":
        kw["softmax_scale"] = 0.3
    elif change == "quant":
        kw["quant"] = "int8"
    elif change == "skip":
        kw["skip"] = attention_mod.SkipSoftmaxConfig(threshold=0.2, disabled_until_timestep=0.5)
    elif change == "timestep-gate":
        kw["timestep"] = 0.2  # the gate opens: skip-softmax now runs
    elif change == "stats":
        kw["collect_stats"] = True
    else:  # the same lengths in a new layout object
        kw["layout"] = PackedLayout.dense(1, 32, 32, "cpu")
    _, res = run_attention(q, k, v, **kw)
    assert decisions[0] == 2
    if change == "timestep-gate":
        assert res.sparse
    if change == "quant":
        assert res.sage


def test_a_timestep_inside_the_gate_keeps_the_plan(decisions):
    q, k, v = _qkv()
    skip = attention_mod.SkipSoftmaxConfig(threshold=0.1, disabled_until_timestep=0.5)
    for t in (0.4, 0.3, 0.2):  # a new t each step: the same plan, this call's skip factor
        _, res = run_attention(q, k, v, backend="reference", skip=skip, timestep=t)
        assert res.sparse
    assert decisions[0] == 1


def test_a_new_route_invalidates_the_plans(decisions, monkeypatch):
    q, k, v = _qkv()
    run_attention(q, k, v, backend="reference")
    ref = registry.get_route("reference")
    monkeypatch.setitem(registry._ROUTES, "reference", ref)
    registry.register_route(ref)  # (the same route again: the registry changed all the same)
    run_attention(q, k, v, backend="reference")
    assert decisions[0] == 2


def test_bad_input_still_raises_after_a_plan(decisions):
    q, k, v = _qkv()
    run_attention(q, k, v, backend="reference")
    with pytest.raises(ValueError, match="timestep"):
        run_attention(q, k, v, backend="reference", timestep=2.0)
    with pytest.raises(ValueError):
        run_attention(q, k[:, :, :1], v, backend="reference")


def test_eager_serving_skips_the_custom_op_only_outside_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert intercept._eager()
    with FakeTensorMode():
        assert not intercept._eager()


def test_a_planned_call_is_the_call_its_fields_build():
    q, k, v = (x[0] for x in _qkv())
    built = registry.AttentionCall(q, k, v, PackedLayout.dense(1, 32, 32, "cpu"), 0.125, 0.5, QuantConfig("int8"),
                                   True, "joint", True, 2)
    assembled = registry.AttentionCall.assemble(built.fixed_fields(), q, k, v, 0.5)
    assert all(getattr(assembled, f.name) is getattr(built, f.name) for f in fields(registry.AttentionCall))
    with pytest.raises(FrozenInstanceError):
        assembled.q = q


# ---- served calls (LayerState.serve): what a layer reuses holds only while its inputs and settings do -------------
def _layer(**settings):
    model, _ = tiny_models.build("flux")
    proc = TrtllmAttnProcessor(backend="reference", policy="always", **settings)
    install(model, proc)
    return proc, layer_of(model.transformer_blocks[0].attn)


def _serve(state, q, k, v, mask=None, text=8):
    return state.serve(q, k, v, mask, None, None, None, q.shape[1] - text, text, False)


def _sdpa(q, k, v, mask=None):
    """Stock attention in float32 on ``[B, S, H, D]`` tensors (``mask``: ``[B, keys]``, True = attend)."""
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    mask = None if mask is None else mask[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def test_a_new_shape_or_dtype_is_laid_out_afresh(decisions):
    _, state = _layer()
    for tokens, dtype in ((24, torch.float32), (24, torch.float32), (40, torch.float32), (24, torch.bfloat16)):
        q, k, v = _qkv(tokens, seed=tokens, dtype=dtype)
        out = _serve(state, q, k, v)
        assert out.shape == q.shape and out.dtype == dtype
        torch.testing.assert_close(out.float(), _sdpa(q, k, v), rtol=2e-2, atol=2e-2)
    assert decisions[0] == 3, "the second call of a shape and dtype reuses its plan; each other one decides"


def test_masked_and_unmasked_calls_of_one_layer_keep_their_own_layouts():
    _, state = _layer()
    q, k, v = _qkv(24)
    mask = torch.ones(1, 24, dtype=torch.bool)
    mask[0, 3:8] = False  # text padding
    for m in (None, mask, None, mask):
        torch.testing.assert_close(_serve(state, q, k, v, m), _sdpa(q, k, v, m), rtol=1e-4, atol=1e-4)


def test_the_timestep_gate_is_read_on_every_call(decisions):
    proc, state = _layer(skip_softmax_threshold=0.5, disabled_until_timestep=0.5)
    q, k, v = _qkv(24)
    sparse = []
    for t in (0.9, 0.3, 0.2, 0.9):
        proc.set_timestep(t)
        _serve(state, q, k, v)
        sparse.append(state.records[-1].sparse)
    assert sparse == [False, True, True, False]
    assert decisions[0] == 2, "one plan with skip-softmax and one without; a new t inside the gate keeps it"


@pytest.fixture
def routed(monkeypatch):
    """Every ``AttentionCall`` the reference route runs, in order."""
    calls = []
    route = type(registry.get_route("reference"))
    run = route.run
    monkeypatch.setattr(route, "run", lambda self, call: calls.append(call) or run(self, call))
    return calls


def test_collect_stats_changed_between_calls_is_seen(routed):
    proc, state = _layer(skip_softmax_threshold=0.5)
    q, k, v = _qkv(24)
    _serve(state, q, k, v)
    proc.collect_stats = True
    _serve(state, q, k, v)
    assert [call.collect_stats for call in routed] == [False, True]


def test_skip_softmax_not_configured_runs_dense(routed):
    _, state = _layer(quant="int8")
    q, k, v = _qkv(24)
    _serve(state, q, k, v)
    assert routed[-1].skip_factor is None and routed[-1].quant.dtype_qk == "int8"
    assert not state.records[-1].sparse and state.records[-1].sage


def test_a_calibration_renewed_between_calls_is_seen(routed):
    _, state = _layer(target_sparsity=0.5)
    q, k, v = _qkv(24)
    for a in (2.0, 3.0):
        state.calibration = Calibration(a=a, b=0.0)  # factor = a * exp(b * target_sparsity) = a
        state.refresh()
        _serve(state, q, k, v)
    assert [call.skip_factor for call in routed] == [2.0, 3.0]


def test_layers_of_one_shape_share_the_processors_layout(decisions, routed):
    model, _ = tiny_models.build("flux")
    proc = TrtllmAttnProcessor(backend="reference", policy="always")
    install(model, proc)
    joint, single = (layer_of(m.attn) for m in (model.transformer_blocks[0], model.single_transformer_blocks[0]))
    q, k, v = _qkv(24)
    _serve(joint, q, k, v)
    proc.collect_stats = True  # (another plan)
    _serve(single, q, k, v)
    assert routed[0].layout is routed[1].layout, "one layout per shape (FlashInfer plans once per layout)"
