"""The PyTorch oracle: exact dense attention, the skip rule, SAGE quantization.

Measured here (CPU, fp32, seed 0) and asserted with margin below:
- dense vs SDPA: max abs error < 1e-5 on ragged batches;
- SAGE on Gaussian inputs (4096 tokens, 4 heads, head dim 128): relative L1
  0.038 (int8) and 0.053 (fp8 e4m3) against dense; QK quantization alone gives
  0.011, fp8 V with per-channel scales alone 0.026 (flat attention over Gaussian
  data makes V's rounding dominate);
- skip-softmax on inputs with positional locality: see test_skip_fraction_grows_and_error_is_bounded.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import cosine, rel_l1
from diffusers_trtllm import QuantConfig, SkipSoftmaxConfig, run_attention
from diffusers_trtllm.bench.ring_skip import ring_reference
from diffusers_trtllm.kernels.reference import block_ids, reference_attention, sage_quantize


def _packed(lens_q, lens_kv, heads=4, kv_heads=None, dim=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    kv_heads = kv_heads or heads
    q = torch.randn(sum(lens_q), heads, dim, generator=g, dtype=dtype)
    k = torch.randn(sum(lens_kv), kv_heads, dim, generator=g, dtype=dtype)
    v = torch.randn(sum(lens_kv), kv_heads, dim, generator=g, dtype=dtype)
    cu = lambda lens: torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()], dtype=torch.int32)
    return q, k, v, cu(lens_q), cu(lens_kv)


def _sdpa_per_sequence(q, k, v, cu_q, cu_kv, scale):
    outs = []
    for i in range(len(cu_q) - 1):
        qs = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1)
        ks = k[cu_kv[i] : cu_kv[i + 1]].transpose(0, 1)
        vs = v[cu_kv[i] : cu_kv[i + 1]].transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(qs[None], ks[None], vs[None], scale=scale, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outs)


def structured(tokens, heads, dim, locality, seed=0):
    """Q/K sharing a positional code: scores fall off with token distance (``locality`` = strength)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(tokens, dtype=torch.float32)[:, None]
    freqs = torch.exp(-math.log(1000.0) * torch.arange(dim // 2) / (dim // 2))[None]
    code = torch.cat([torch.sin(pos * freqs), torch.cos(pos * freqs)], dim=-1)[:, None, :]
    q = locality * code + torch.randn(tokens, heads, dim, generator=g)
    k = locality * code + torch.randn(tokens, heads, dim, generator=g)
    v = torch.randn(tokens, heads, dim, generator=g)
    return q, k, v


@pytest.mark.parametrize(
    "lens_q, lens_kv, kv_heads",
    [((200,), (200,), None), ((130, 7, 300), (90, 260, 1), None), ((64, 129), (257, 33), 2)],
)
def test_dense_matches_sdpa(lens_q, lens_kv, kv_heads):
    q, k, v, cu_q, cu_kv = _packed(lens_q, lens_kv, kv_heads=kv_heads)
    scale = 0.125
    expected = _sdpa_per_sequence(q, k, v, cu_q, cu_kv, scale)
    for factor in (None, 0.0):  # threshold 0 skips nothing
        res = reference_attention(q, k, v, cu_q, cu_kv, lens_q, lens_kv, softmax_scale=scale, skip_factor=factor)
        assert (res.out - expected).abs().max() < 1e-5
        assert res.skipped_tiles == 0


def test_tile_count_and_parameters():
    q, k, v, cu_q, cu_kv = _packed((300, 64), (200, 64))
    res = reference_attention(q, k, v, cu_q, cu_kv, (300, 64), (200, 64), softmax_scale=0.1, tile_q=64, tile_kv=32)
    # heads * (q tiles * kv tiles) per sequence: 4 * (5 * 7 + 1 * 2)
    assert res.total_tiles == 4 * (5 * 7 + 1 * 2)


def test_skip_fraction_grows_and_error_is_bounded():
    # Measured (2048 tokens, 2 heads, dim 64, locality 1.5, 64x64 tiles): threshold 1e-3 / 1e-2 / 3e-2 /
    # 1e-1 / 3e-1 skip 0.0 / 0.001 / 0.046 / 0.248 / 0.396 of the tiles at relative L1 0 / 0 / 0.0037 /
    # 0.028 / 0.064.
    q, k, v = structured(2048, 2, 64, locality=1.5)
    cu = torch.tensor([0, 2048], dtype=torch.int32)
    dense = reference_attention(q, k, v, cu, cu, (2048,), (2048,), softmax_scale=0.125).out
    fractions, errors = [], []
    for threshold in (1e-3, 1e-2, 3e-2, 1e-1, 3e-1):
        res = reference_attention(
            q, k, v, cu, cu, (2048,), (2048,), softmax_scale=0.125, skip_factor=threshold * 2048, tile_q=64, tile_kv=64
        )
        fractions.append(res.skipped_fraction)
        errors.append(rel_l1(res.out, dense))
    assert all(b > a for a, b in zip(fractions[1:], fractions[2:])), fractions
    assert all(b > a for a, b in zip(errors[1:], errors[2:])), errors
    assert fractions[-1] > 0.3 and errors[0] < 1e-4
    assert errors[-1] < 0.1, errors


def test_skipped_tile_adds_nothing():
    # Sequence of 2 KV tiles where the second holds only hopeless keys: skipping it equals dropping it.
    q = torch.ones(4, 1, 8)
    k = torch.cat([torch.ones(4, 1, 8), -torch.ones(4, 1, 8)])
    v = torch.randn(8, 1, 8)
    cu_q, cu_kv = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32)
    res = reference_attention(q, k, v, cu_q, cu_kv, (4,), (8,), softmax_scale=1.0, skip_factor=8 * 0.5, tile_q=4, tile_kv=4)
    assert res.skipped_tiles == 1 and res.total_tiles == 2
    assert torch.allclose(res.out, v[:4].mean(0).expand(4, 1, 8), atol=1e-6)


def test_block_ids_follow_flashinfer_layout():
    cu = torch.tensor([0, 5, 6, 23], dtype=torch.int32)
    ids, slots = block_ids(cu, (5, 1, 17), 4)
    # token t of sequence b -> cu[b] // 4 + b + t // 4, out of ceil(23 / 4) + 3 - 1 slots
    expected = [0, 0, 0, 0, 1] + [2] + [3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7]
    assert ids.tolist() == expected and slots == 8
    for b in range(3):  # a block never straddles two sequences
        seq = set(ids[cu[b] : cu[b + 1]].tolist())
        others = set(ids.tolist()) - seq
        assert not seq & others


def test_block_ids_split_per_thread_deal_each_block_to_four_lanes():
    cu = torch.tensor([0, 20, 37], dtype=torch.int32)
    ids, slots = block_ids(cu, (20, 17), 16, per_thread=True)
    lanes = [0, 0, 1, 1, 2, 2, 3, 3] * 2  # key j of a block: lane (j % 8) // 2
    # sequence 0: blocks 0 and 1 (slots 4 * block + lane); sequence 1: 20 // 16 + 1 = block 2 onwards
    expected = lanes + [4, 4, 5, 5] + [8 + x for x in lanes] + [12]
    assert ids.tolist() == expected and slots == 4 * (-(-37 // 16) + 1)


@pytest.mark.parametrize("dtype_qk", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("q_block, k_block", [(1, 16), (4, 4), (16, 1), (1, 128)])
def test_sage_quantize_layout(dtype_qk, q_block, k_block):
    lens = (37, 50)
    q, k, v, cu_q, cu_kv = _packed(lens, lens, dtype=torch.float16)
    cfg = QuantConfig(dtype_qk=dtype_qk, q_block_size=q_block, k_block_size=k_block)
    s = sage_quantize(q, k, v, cu_q, cu_kv, lens, lens, cfg)
    assert s.q.dtype == cfg.qk_dtype and s.v.dtype == torch.float8_e4m3fn
    assert s.q_scale.shape == (4, -(-87 // q_block) + 1) and s.k_scale.shape == (4, -(-87 // k_block) + 1)
    assert s.v_scale.shape == (4, 64)
    assert torch.allclose(s.v_scale, v.float().abs().amax(0) / 448.0)
    # each block's scale is its amax / M
    amax = q.float().abs().amax(-1)
    block_amax = torch.zeros_like(s.q_scale.t()).scatter_reduce_(0, s.q_block_id[:, None].expand(-1, 4), amax, "amax")
    used = s.q_block_id.unique()
    assert torch.allclose(s.q_scale.t()[used], block_amax[used].clamp_min(1e-3) / cfg.qk_max)
    dq, dk, dv = s.dequantize()
    step = s.q_scale.t()[s.q_block_id][:, :, None]
    tol = 0.5 if dtype_qk == "int8" else 16.0  # half a step (int8); e4m3 steps are 2^-3 relative at most
    assert ((dq - q.float()).abs() <= tol * step + 1e-6).all()
    if dtype_qk == "int8":
        assert s.q.abs().max() <= 127


def test_sage_error_on_gaussian_inputs():
    lens = (4096,)
    q, k, v, cu, _ = _packed(lens, lens, dim=128)
    dense = reference_attention(q, k, v, cu, cu, lens, lens, softmax_scale=128**-0.5).out
    measured = {}
    for dtype_qk, bound in (("int8", 0.05), ("fp8_e4m3", 0.07)):
        out = reference_attention(q, k, v, cu, cu, lens, lens, softmax_scale=128**-0.5, quant=QuantConfig(dtype_qk)).out
        measured[dtype_qk] = (rel_l1(out, dense), cosine(out, dense))
        assert measured[dtype_qk][0] < bound and measured[dtype_qk][1] > 0.99, measured


def test_sage_error_on_structured_inputs_is_lower():
    # Measured: int8 0.027 (cosine 0.9995), fp8 e4m3 0.065 (cosine 0.9957).
    q, k, v = structured(2048, 2, 128, locality=4.0)
    cu = torch.tensor([0, 2048], dtype=torch.int32)
    dense = reference_attention(q, k, v, cu, cu, (2048,), (2048,), softmax_scale=128**-0.5).out
    out = reference_attention(q, k, v, cu, cu, (2048,), (2048,), softmax_scale=128**-0.5, quant=QuantConfig("int8")).out
    assert rel_l1(out, dense) < 0.03


def test_smooth_k_keeps_softmax():
    lens = (300,)
    q, k, v, cu, _ = _packed(lens, lens)
    k = k + 3.0  # a large shared offset: smoothing removes it before quantization
    dense = reference_attention(q, k, v, cu, cu, lens, lens, softmax_scale=0.125).out
    plain = reference_attention(q, k, v, cu, cu, lens, lens, softmax_scale=0.125,
                                quant=QuantConfig("int8", smooth_k=False)).out
    smooth = reference_attention(q, k, v, cu, cu, lens, lens, softmax_scale=0.125, quant=QuantConfig("int8")).out
    assert QuantConfig("int8").smooth_k and QuantConfig.coerce({"dtype_qk": "int8"}).smooth_k  # the default
    assert rel_l1(smooth, dense) < rel_l1(plain, dense)


def test_smoothed_lse_is_the_unsmoothed_logits_one():
    """Taking K's mean off shifts each row's logits alike: the output stays, and the log-sum-exp handed back
    (what ring attention merges KV shards by) is the one of the logits before smoothing, within int8's error."""
    lens = (300,)
    q, k, v, cu, _ = _packed(lens, lens)
    k = k + 3.0
    dense = reference_attention(q, k, v, cu, cu, lens, lens, softmax_scale=0.125)
    smooth = reference_attention(q, k, v, cu, cu, lens, lens, softmax_scale=0.125, quant=QuantConfig("int8"))
    shift = 0.125 * 3.0 * q.float().sum(-1)  # what smoothing took off each row's logits
    error = (smooth.lse - dense.lse).abs().max()
    assert error < 0.1 and error < 0.02 * shift.abs().max()


def test_long_sequence_runs_in_bounded_memory():
    # 32k tokens, 12 heads (wan_1.3b_480p's attention); one head computed to keep CI fast.
    tokens = 32760
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(tokens, 12, 64, generator=g, dtype=torch.float16) for _ in range(3))
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    res = reference_attention(
        q, k, v, cu, cu, (tokens,), (tokens,), softmax_scale=0.125, skip_factor=0.01 * tokens, heads=slice(0, 1)
    )
    assert res.out.shape == (tokens, 1, 64) and torch.isfinite(res.out).all()
    assert res.total_tiles == 256 * 256


def test_run_attention_reference_route_and_masks():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 100, 2, 32, generator=g) for _ in range(3))
    mask = torch.rand(2, 100, generator=g) > 0.5
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None]
    ).transpose(1, 2)
    for backend in ("sdpa", "reference"):
        out, result = run_attention(q, k, v, attn_mask=mask, backend=backend)
        assert result.route == backend and (out - expected).abs().max() < 1e-5
    additive = torch.zeros(2, 1, 1, 100).masked_fill(~mask[:, None, None], float("-inf"))
    assert (run_attention(q, k, v, attn_mask=additive)[0] - expected).abs().max() < 1e-5


def test_skip_softmax_through_run_attention_reports_stats():
    q, k, v = structured(1024, 2, 64, locality=4.0)
    q, k, v = q[None], k[None], v[None]
    _, result = run_attention(q, k, v, backend="reference", skip=SkipSoftmaxConfig(threshold=0.05))
    assert result.route == "reference" and result.skipped_fraction > 0


def test_lse_is_the_logsumexp_and_kv_shards_merge_like_ring():
    q, k, v, cu_q, cu_kv = _packed((200, 70), (300, 90))
    scale = 0.125
    res = reference_attention(q, k, v, cu_q, cu_kv, (200, 70), (300, 90), softmax_scale=scale)
    scores = torch.einsum("qhd,khd->hqk", q[:200], k[:300]) * scale
    torch.testing.assert_close(res.lse[:200], torch.logsumexp(scores, -1).t(), rtol=1e-5, atol=1e-5)
    # One sequence's keys in 2 shards of 150 (a shard boundary inside a tile), merged as Diffusers' ring does.
    full = reference_attention(q[:200], k[:300], v[:300], cu_q[:2], cu_kv[:2], (200,), (300,), softmax_scale=scale)
    ring = ring_reference(q[:200], k[:300], v[:300], 2, softmax_scale=scale)
    torch.testing.assert_close(ring.out, full.out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ring.lse, full.lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shards", [2, 4])
def test_skip_with_a_shard_local_running_max_skips_a_subset(shards):
    """Ring: each rank runs the skip rule on its KV shard, its running max local to the shard.

    A shard's running max never exceeds one process's, so it skips only tiles one process skips.
    Measured (2048 tokens, 2 heads, dim 64, locality 1.5, 64x64 tiles, threshold 0.1): one process
    skips 0.248 of the tiles at rel-L1 0.028; 2 shards 0.076 at 0.012; 4 shards 0.011 at 0.0027
    (the keys a row attends to sit in one shard; the others' own maxima are low). docs/design.md.
    """
    q, k, v = structured(2048, 2, 64, locality=1.5)
    cu = torch.tensor([0, 2048], dtype=torch.int32)
    threshold, tiles = 0.1, dict(tile_q=64, tile_kv=64)
    dense = reference_attention(q, k, v, cu, cu, (2048,), (2048,), softmax_scale=0.125).out
    one = reference_attention(q, k, v, cu, cu, (2048,), (2048,), softmax_scale=0.125, skip_factor=threshold * 2048,
                              **tiles)
    ring = ring_reference(q, k, v, shards, softmax_scale=0.125, threshold=threshold, **tiles)
    assert ring.total_tiles == one.total_tiles
    assert 0 < ring.skipped_tiles < one.skipped_tiles
    assert rel_l1(ring.out, dense) < rel_l1(one.out, dense)


def test_v_mean_taken_off_keeps_fp16_outputs_finite_at_its_limit():
    """V full of values at fp16's limit: fp8's rounding of V less its mean can take an average past 65,504, which
    an average of V cannot reach; the output is clamped there (as the kernels store it), NaN kept."""
    gen = torch.Generator().manual_seed(7)
    lens = (300, 517)
    q, k, v = ((torch.randn(sum(lens), 2, 128, generator=gen) * 6e4).clamp(-65504, 65504).half() for _ in range(3))
    cu = torch.tensor([0, 300, 817], dtype=torch.int32)
    kw = dict(softmax_scale=128**-0.5, quant=QuantConfig("int8"), smooth_v=True)
    wide = reference_attention(q.float(), k.float(), v.float(), cu, cu, lens, lens, **kw).out
    assert wide.abs().max() > 65504  # the overshoot this guards against
    out = reference_attention(q, k, v, cu, cu, lens, lens, **kw).out
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    v[5, 0, 0] = float("nan")
    assert torch.isnan(reference_attention(q, k, v, cu, cu, lens, lens, **kw).out).any()


def test_a_nonfinite_key_stays_in_its_sequence_with_smooth_k():
    """smooth_k's mean spans the batch: an inf key must not reach the other sequence through it (dense attention
    keeps it to the rows of its own sequence), so that channel is left unsmoothed."""
    lens = (200, 300)
    q, k, v, cu, _ = _packed(lens, lens)
    k[250, 1, 3] = math.inf
    for quant in (None, QuantConfig("int8")):
        out = reference_attention(q, k, v, cu, cu, lens, lens, softmax_scale=0.125, quant=quant).out
        assert torch.isfinite(out[:200]).all() and not torch.isfinite(out[200:]).all()
