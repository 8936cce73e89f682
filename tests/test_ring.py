"""Ring attention's pieces on one process: routes that return the log-sum-exp, the per-KV-shard skip
rule through ``run_attention`` against the simulation (``bench.ring_skip``), and route reasons."""

from __future__ import annotations

import pytest
import torch

from diffusers_trtllm.attention import run_attention
from diffusers_trtllm.bench.inputs import Shape, structured_qkv
from diffusers_trtllm.bench.ring_skip import merge_by_lse, ring_reference
from diffusers_trtllm.layout import PackedLayout
from diffusers_trtllm.routing.registry import AttentionCall, get_route, route_names

SHAPE = Shape("ring", 1, 1024, 2, 64, (4, 16, 16))


@pytest.mark.parametrize("shards", [2, 4])
@pytest.mark.parametrize("threshold", [None, 0.05])
def test_kv_shards_through_run_attention_match_the_simulation(shards, threshold):
    """Each shard through ``run_attention(return_lse=True, kv_shards=n)`` (what a ring rank runs), merged as
    Diffusers merges: the same output, LSE and skipped tiles as the simulation, and dense equals one process."""
    q, k, v = structured_qkv(SHAPE, 0.5, seed=1, dtype=torch.float32)
    shard = SHAPE.tokens // shards
    parts, skipped = [], 0
    for i in range(shards):
        part = slice(i * shard, (i + 1) * shard)
        out, res = run_attention(q, k[:, part], v[:, part], backend="reference", skip=threshold, return_lse=True,
                                 kv_shards=shards, collect_stats=True)
        assert res.lse.shape == (1, SHAPE.tokens, SHAPE.heads) and res.lse.dtype == torch.float32
        parts.append((out, res.lse))
        skipped += res.skipped_tiles
    out, lse = merge_by_lse(parts)
    sim = ring_reference(q[0], k[0], v[0], shards, softmax_scale=SHAPE.head_dim ** -0.5, threshold=threshold)
    torch.testing.assert_close(out[0], sim.out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[0], sim.lse, rtol=1e-5, atol=1e-5)
    assert skipped == sim.skipped_tiles
    if threshold is None:
        one = run_attention(q, k, v, backend="reference")[0]
        torch.testing.assert_close(out, one, rtol=1e-5, atol=1e-5)
    else:
        assert skipped > 0


def test_calibrated_lambda_follows_the_whole_sequence():
    """A calibrated factor gives ``lambda = factor / kv_len`` of the whole sequence, not of the shard."""
    from diffusers_trtllm.attention import resolve_skip_factor
    from diffusers_trtllm.config import SkipSoftmaxConfig

    calibrated = SkipSoftmaxConfig(target_sparsity=0.5, a=100.0, b=1.0)
    full = resolve_skip_factor(calibrated, 4096, None) / 4096
    assert resolve_skip_factor(calibrated, 1024, None, kv_shards=4) / 1024 == pytest.approx(full)
    threshold = SkipSoftmaxConfig(threshold=0.05)
    assert resolve_skip_factor(threshold, 1024, None, kv_shards=4) / 1024 == pytest.approx(0.05)


def test_routes_say_whether_they_return_the_lse():
    q = torch.zeros(64, 2, 128, dtype=torch.bfloat16)
    layout = PackedLayout.dense(1, 64, 64, "cpu")
    call = AttentionCall(q, q, q, layout, softmax_scale=0.1, return_lse=True, kv_shards=2)
    lse_routes = {name for name in route_names() if get_route(name).caps.lse}
    assert lse_routes == {"fa3", "fmha-v2", "fmha-v2-fp8", "sage-sm90", "triton", "reference"}
    for name in route_names():
        reasons = get_route(name).not_supported_reasons(call)
        assert any("log-sum-exp" in r for r in reasons) == (name not in lse_routes), (name, reasons)
