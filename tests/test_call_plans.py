"""A call of known shapes and settings reuses its decided plan (layout, policy, route), and only then."""

from __future__ import annotations

import importlib

import pytest
import torch

from diffusers_trtllm import run_attention
from diffusers_trtllm.routing import registry
from diffusers_trtllm.serving import intercept

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


def _qkv(tokens=32, heads=2, dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, tokens, heads, dim, generator=gen) for _ in range(3)]


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
    from diffusers_trtllm.layout import PackedLayout

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
