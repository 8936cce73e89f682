"""Property tests (Hypothesis): every CPU route against torch's attention and the reference over drawn shapes,
ragged lengths, masks (bool and additive, padding anywhere, rows with no key), grouped-query heads, head dims
and controls; and bad draws raise the documented errors (issue 13).

One fixed profile: derandomized (the same examples on every run), bounded example counts, no deadline, so
CI time stays well under two minutes.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffusers_trtllm import QuantConfig, SkipSoftmaxConfig, TrtllmAttnProcessor, attention, run_attention
from diffusers_trtllm.config import ControlTypeError
from diffusers_trtllm.kernels.reference import reference_attention, sage_quantize
from diffusers_trtllm.layout import MaskNotSupportedError

PROFILE = settings(
    derandomize=True, max_examples=100, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FEW = settings(PROFILE, max_examples=40)


@st.composite
def problems(draw, max_len: int = 48):
    """q/k/v ``[batch, tokens, heads, dim]`` and an optional key-padding mask in one of the accepted forms."""
    batch = draw(st.integers(1, 3))
    q_len = draw(st.integers(1, max_len))
    kv_len = q_len if draw(st.booleans()) else draw(st.integers(1, max_len))
    kv_heads = draw(st.integers(1, 3))
    heads = kv_heads * draw(st.integers(1, 3))
    dim = draw(st.sampled_from([8, 16, 24, 64]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    sharp = draw(st.sampled_from([1.0, 3.0]))  # sharper scores exercise the skip rule
    q = torch.randn(batch, q_len, heads, dim, generator=gen) * sharp
    k = torch.randn(batch, kv_len, kv_heads, dim, generator=gen) * sharp
    v = torch.randn(batch, kv_len, kv_heads, dim, generator=gen)
    kind = draw(st.sampled_from(["none", "bool", "bool4d", "additive_inf", "additive_1e4"]))
    if kind == "none":
        return q, k, v, None
    valid = torch.tensor(draw(st.lists(st.lists(st.booleans(), min_size=kv_len, max_size=kv_len),
                                       min_size=batch, max_size=batch)))
    if valid.sum(dim=1).eq(0).all():  # at least one row with a key: an all-empty batch is refused (tested below)
        valid[0, draw(st.integers(0, kv_len - 1))] = True
    if kind == "bool":
        mask = valid if batch != q_len else valid[:, None, None, :]  # 2-D [batch, kv] unless ambiguous
    elif kind == "bool4d":
        mask = valid[:, None, None, :]
    else:
        fill = -math.inf if kind == "additive_inf" else -10000.0
        mask = torch.zeros(batch, 1, 1, kv_len).masked_fill(~valid[:, None, None, :], fill)
    return q, k, v, mask


def _stock(q, k, v, mask, scale=None):
    """torch's SDPA in float64, as a family's stock attention computes it."""
    if mask is not None and mask.ndim == 2:
        mask = mask[:, None, None, :]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    out = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(1, 2), k.double().transpose(1, 2), v.double().transpose(1, 2), attn_mask=mask,
        scale=scale, enable_gqa=k.shape[2] != q.shape[2],
    )
    return out.transpose(1, 2)


@PROFILE
@given(problems())
def test_dense_routes_match_stock_attention(problem):
    q, k, v, mask = problem
    expected = _stock(q, k, v, mask)
    for backend in ("sdpa", "reference", "auto"):
        out = attention(q, k, v, attn_mask=mask, backend=backend)
        assert out.shape == q.shape and out.dtype == q.dtype
        torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)


@FEW
@given(problems(), st.floats(0.0, 0.999))
def test_skip_counts_do_not_depend_on_packing(problem, threshold):
    """A padded, masked batch skips exactly the tiles its sequences skip alone (the rule is per sequence)."""
    q, k, v, mask = problem
    skip = SkipSoftmaxConfig(threshold=threshold)
    out, res = run_attention(q, k, v, attn_mask=mask, skip=skip, backend="reference", collect_stats=True)
    if mask is None:
        valid = torch.ones(q.shape[0], k.shape[1], dtype=torch.bool)
    elif mask.dtype == torch.bool:
        valid = mask.reshape(q.shape[0], -1)
    else:
        valid = mask.reshape(q.shape[0], -1) == 0
        valid |= ~valid.any(dim=1, keepdim=True) & (mask.reshape(q.shape[0], -1) > -math.inf).all(dim=1, keepdim=True)
    skipped = total = 0
    for b in range(q.shape[0]):
        keys = valid[b].nonzero().flatten()
        if keys.numel() == 0:
            assert out[b].eq(0).all()  # no key: zero rows, as torch's SDPA
            continue
        alone = SkipSoftmaxConfig(threshold=threshold * valid.sum(dim=1).max().item() / keys.numel())
        o, r = run_attention(q[b : b + 1], k[b : b + 1, keys], v[b : b + 1, keys], skip=alone, backend="reference",
                             collect_stats=True)
        torch.testing.assert_close(out[b : b + 1], o, rtol=1e-5, atol=1e-6)
        skipped, total = skipped + r.skipped_tiles, total + r.total_tiles
    assert (res.skipped_tiles, res.total_tiles) == (skipped, total)


@FEW
@given(problems(), st.floats(0.0, 0.999))
def test_threshold_zero_is_dense_and_skip_stays_finite(problem, threshold):
    q, k, v, mask = problem
    dense = attention(q, k, v, attn_mask=mask, backend="reference")
    out, res = run_attention(q, k, v, attn_mask=mask, skip=0.0, backend="reference", collect_stats=True)
    assert res.skipped_tiles == 0 and torch.equal(out, dense)
    sparse = attention(q, k, v, attn_mask=mask, skip={"threshold": threshold}, backend="reference")
    assert torch.isfinite(sparse).all()


@FEW
@given(problems(max_len=40), st.sampled_from(["int8", "fp8_e4m3"]), st.sampled_from([1, 4, 16]),
       st.sampled_from([1, 4, 16, 128]), st.booleans(), st.booleans())
def test_sage_within_its_quantization_bound(problem, dtype_qk, q_block, k_block, smooth_k, smooth_v):
    """Dequantized Q/K are within half a step of the inputs (int8) or one e4m3 rounding (fp8), V (less its
    mean with smooth_v) within one e4m3 rounding; outputs stay close, with and without V's mean taken off."""
    q, k, v, mask = problem
    quant = QuantConfig(dtype_qk, q_block, k_block, smooth_k)
    flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
    lens_q, lens_kv = (q.shape[1],) * q.shape[0], (k.shape[1],) * k.shape[0]

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    sage = sage_quantize(*flat, cu(lens_q), cu(lens_kv), lens_q, lens_kv, quant, smooth_v=smooth_v)
    dq, dk, dv = sage.dequantize()
    target_v = flat[2].float() - sage.v_mean if smooth_v else flat[2].float()
    assert ((target_v - dv).abs() <= target_v.abs() * 2.0**-4 + sage.v_scale * 2.0**-9 * (1 + 1e-5) + 1e-7).all()
    target_k = flat[1] - flat[1].mean(dim=0, keepdim=True) if smooth_k else flat[1]
    for x, deq, scale in ((flat[0], dq, sage.q_scale.t()[sage.q_block_id]), (target_k, dk, sage.k_scale.t()[sage.k_block_id])):
        step = scale[:, :, None] * (0.5 if dtype_qk == "int8" else 1.0)
        bound = step if dtype_qk == "int8" else x.abs() * 2.0**-4 + step * 2.0**-9
        assert ((x - deq).abs() <= bound * (1 + 1e-5) + 1e-7).all()
    out = attention(q, k, v, attn_mask=mask, quant=quant, backend="reference")
    dense = attention(q, k, v, attn_mask=mask, backend="reference")
    if smooth_v and mask is None:  # the emulation of the project's Hopper kernels, on the packed sequences
        out = reference_attention(*flat, cu(lens_q), cu(lens_kv), lens_q, lens_kv, softmax_scale=q.shape[-1] ** -0.5,
                                  quant=quant, smooth_v=True).out.view(dense.shape)
    assert torch.isfinite(out).all()
    err = (out - dense).abs().sum() / dense.abs().sum().clamp_min(1e-12)
    assert err < (0.15 if dtype_qk == "int8" else 0.35), f"rel-L1 {err:.3g}"


# ---- bad draws raise the documented errors ---------------------------------------------------------

_not_a_number = st.one_of(st.text(max_size=3), st.lists(st.integers(), max_size=2), st.booleans(),
                          st.builds(dict, a=st.integers()))


@PROFILE
@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not 0.0 <= x < 1.0),
                 st.integers(max_value=-1), st.integers(min_value=1)))
def test_bad_thresholds_raise_value_error(threshold):
    with pytest.raises(ValueError, match="skip_softmax_threshold must be finite and in"):
        TrtllmAttnProcessor(skip_softmax_threshold=threshold)
    with pytest.raises(ValueError, match="skip_softmax_threshold"):
        SkipSoftmaxConfig.coerce({"threshold": threshold})


@PROFILE
@given(_not_a_number)
def test_bad_types_raise_type_errors_naming_the_control(value):
    for build, name in (
        (lambda x: TrtllmAttnProcessor(skip_softmax_threshold=x), "skip_softmax_threshold"),
        (lambda x: TrtllmAttnProcessor(disabled_until_timestep=x), "disabled_until_timestep"),
        (lambda x: SkipSoftmaxConfig(target_sparsity=x), "target_sparsity"),
    ):
        with pytest.raises(ControlTypeError, match=name):
            build(value)
    if not isinstance(value, (str, dict)):  # a str is a dtype name, a dict the long form
        with pytest.raises(ControlTypeError, match="quant"):
            TrtllmAttnProcessor(quant=value)


@PROFILE
@given(st.text(min_size=1, max_size=12).filter(lambda s: s.lower() not in ("int8", "fp8", "fp8_e4m3", "e4m3",
                                                                                  "float8_e4m3fn")))
def test_unknown_dtype_names_raise_value_error(name):
    with pytest.raises(ValueError, match="quant.dtype_qk must be one of"):
        TrtllmAttnProcessor(quant=name)


@PROFILE
@given(problems(max_len=16), st.sampled_from(["kv_len", "dtype", "all_empty", "bias", "ambiguous"]))
def test_bad_masks_and_tensors_raise(problem, fault):
    q, k, v, _ = problem
    batch, kv_len = q.shape[0], k.shape[1]
    if fault == "ambiguous":  # a 2-D [L, S] mask whose rows differ, with batch == q_len == L
        size = kv_len + 1
        q = torch.zeros(size, size, *q.shape[2:])
        k, v = (torch.zeros(size, *x.shape[1:]) for x in (k, v))
        mask = torch.ones(size, kv_len, dtype=torch.bool)
        mask[0, 0] = False
        with pytest.raises(MaskNotSupportedError, match="ambiguous"):
            attention(q, k, v, attn_mask=mask)
    elif fault == "kv_len":
        with pytest.raises(MaskNotSupportedError, match="does not end in kv_len"):
            attention(q, k, v, attn_mask=torch.ones(batch, 1, 1, kv_len + 1, dtype=torch.bool))
    elif fault == "dtype":
        with pytest.raises(ValueError, match="share one floating dtype"):
            attention(q, k.double(), v)
    elif fault == "all_empty":
        with pytest.raises(MaskNotSupportedError, match="no sequence with both"):
            attention(q, k, v, attn_mask=torch.zeros(batch, 1, 1, kv_len, dtype=torch.bool))
    else:
        bias = torch.zeros(batch, 1, 1, kv_len)
        bias[..., 0] = -0.5
        if kv_len == 1:  # one key: the same finite value on every key of the row, which softmax ignores
            torch.testing.assert_close(attention(q, k, v, attn_mask=bias), attention(q, k, v))
            return
        with pytest.raises(MaskNotSupportedError, match="bias"):
            attention(q, k, v, attn_mask=bias)
