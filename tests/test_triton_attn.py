"""The ``triton`` route on the CPU: its kernels under Triton's interpreter against the reference.

``TRITON_INTERPRET=1`` must be set before triton is imported, so the kernel checks
run in one child process (this file run as a script, its reductions vectorized by
``triton_interpreter``, started with the session by ``background_jobs``) and report per
case as each ends; the parent pytest process stays untouched. Tiny ragged shapes with 32 x 32 tiles so
the skip rule, the masked last tiles and the per-sequence scale blocks all get
exercised. fp16/fp32 inputs (bf16 dots are wrong under the interpreter); fp8
runs through the kernels' non-native path (e4m3 rounding done in fp32), as on SM80.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from background_jobs import BackgroundJob
from triton_support import compiled_for, interpreter_missing

ROOT = Path(__file__).resolve().parents[1]
LENS_Q = (37, 70)
LENS_KV = (45, 100)
TILE = 32


def _layout(lq, lkv):
    from diffusers_trtllm.layout import PackedLayout

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    return PackedLayout.from_cu_seqlens(cu(lq), cu(lkv), max(lq), max(lkv), q_tokens=sum(lq), kv_tokens=sum(lkv))


def _structured(lens, heads, dim, gen, locality=3.0):
    """Gaussian plus shared positional features: nearby tokens score higher, so tiles get skipped."""
    pos = torch.cat([torch.arange(n) for n in lens]).float()
    freqs = torch.exp(-torch.arange(dim // 2) / (dim // 2) * math.log(1000.0)) * 0.5
    pe = torch.cat([(pos[:, None] * freqs).cos(), (pos[:, None] * freqs).sin()], -1)
    return torch.randn(len(pos), heads, dim, generator=gen) + locality * pe[:, None]


# ---- checks run in the interpreter child --------------------------------------------------------

def _check_max_nan():
    """``max_nan``, the kernels' one reduction with a combine function of their own (vectorized in this child),
    is ``torch.amax`` along either axis of a tile and down to a scalar: NaN wins, inf and -inf stay."""
    from triton_interpreter import max_nan_kernel

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(4))
    x[1, 3], x[2, 5], x[3, 0], x[4] = math.nan, math.inf, -math.inf, -math.inf
    rows, cols, top = torch.empty(8), torch.empty(16), torch.empty(1)
    max_nan_kernel[(1,)](x, rows, cols, top, 8, 16)
    for got, want in ((rows, x.amax(1)), (cols, x.amax(0)), (top, x.amax()[None])):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def _check_quantize(dtype_qk, q_block, k_block, smooth_k, lens_q=LENS_Q, lens_kv=LENS_KV, mma_key_order=False,
                    k_per_thread=False):
    from diffusers_trtllm.config import QuantConfig
    from diffusers_trtllm.kernels.reference import block_ids, key_mean, sage_quantize
    from diffusers_trtllm.kernels.triton_quant import sage_quantize_triton

    gen = torch.Generator().manual_seed(1)
    layout = _layout(lens_q, lens_kv)
    q = torch.randn(sum(lens_q), 4, 64, generator=gen).half()
    k = (torch.randn(sum(lens_kv), 2, 64, generator=gen) * 3 + 1).half()
    v = torch.randn(sum(lens_kv), 2, 64, generator=gen).half()
    quant = QuantConfig(dtype_qk, q_block, k_block, smooth_k, k_per_thread)
    got = sage_quantize_triton(q, k, v, layout, quant, mma_key_order=mma_key_order)
    _assert_v_mean_close(got.v_mean, v)
    if smooth_k:  # summed in spans: key_mean's up to fp32 rounding, taken as given to compare the rest bit for bit
        torch.testing.assert_close(got.k_mean, key_mean(k), rtol=1e-5, atol=1e-6)
    ref = sage_quantize(q, k, v, layout.cu_seqlens_q, layout.cu_seqlens_kv, layout.q_lens, layout.kv_lens, quant,
                        smooth_v=True, v_mean=got.v_mean, k_mean=got.k_mean)
    q_used = block_ids(layout.cu_seqlens_q, layout.q_lens, q_block)[0].unique()
    k_used = block_ids(layout.cu_seqlens_kv, layout.kv_lens, k_block, k_per_thread)[0].unique()
    assert torch.equal(got.q_scale[:, q_used], ref.q_scale[:, q_used])
    assert torch.equal(got.k_scale[:, k_used], ref.k_scale[:, k_used])
    assert torch.equal(got.v_scale, ref.v_scale)
    for name, a, b in (("q", got.q, ref.q), ("k", got.k, ref.k), ("v", got.v(layout), ref.v)):
        assert torch.equal(a.float(), b.float()), f"{name}: {(a.float() != b.float()).sum()} values differ"
    _assert_gaps_zero(got, layout, mma_key_order)


def _assert_v_mean_close(v_mean, v):
    """The quantizer's V mean (``kv_stats``, summed in spans) is ``channel_mean``'s up to fp32 rounding."""
    from diffusers_trtllm.kernels.reference import channel_mean

    torch.testing.assert_close(v_mean, channel_mean(v), rtol=1e-5, atol=1e-6, equal_nan=True)


def _check_kv_stats():
    """``kv_stats`` over several spans (the last one ragged) and a strided K and V: V's min and max are torch's
    exactly, NaN and inf kept, its channel scales the reference's, the means ``channel_mean``'s and ``key_mean``'s
    (a sample of every other key) up to rounding, 0 where K's is not finite."""
    from diffusers_trtllm.kernels import triton_quant
    from diffusers_trtllm.kernels.reference import AMAX_FLOOR, FP8_MAX, key_mean

    gen = torch.Generator().manual_seed(5)
    v = (torch.randn(3 * 70 + 11, 3, 64, generator=gen) * 2 + 1).half()[:, ::2]  # heads 0 and 2 of 3
    k = (torch.randn(3 * 70 + 11, 3, 64, generator=gen) * 3 - 1).half()[:, 1:]
    v[7, 0, 3], v[100, 1, 9], v[150, 1, 10] = math.nan, math.inf, -math.inf
    k[4, 1, 5] = math.inf  # a sampled key (every other one)
    saved = triton_quant.V_STATS_ROWS, triton_quant.KEY_MEAN_SAMPLE
    triton_quant.V_STATS_ROWS, triton_quant.KEY_MEAN_SAMPLE = 70, 100  # 4 spans, the last ragged; every other key
    try:
        stats = triton_quant.kv_stats(k, v, True)
        sample = k[::2]
    finally:
        triton_quant.V_STATS_ROWS, triton_quant.KEY_MEAN_SAMPLE = saved
    want_lo, want_hi = torch.aminmax(v.float(), dim=0)
    torch.testing.assert_close(stats.v_min, want_lo, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(stats.v_max, want_hi, rtol=0, atol=0, equal_nan=True)
    _assert_v_mean_close(stats.v_mean, v)
    amax = (v.float() - stats.v_mean).abs().amax(dim=0).clamp_min(AMAX_FLOOR)
    torch.testing.assert_close(stats.v_scale, amax / torch.full_like(amax, FP8_MAX), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(stats.k_mean, key_mean(sample), rtol=1e-5, atol=1e-6)
    assert stats.k_mean[1, 5] == 0
    assert triton_quant.kv_stats(k, v, False).k_mean is None


def _check_quantize_many_spans_twice():
    """Statistics spans of 16 keys (10 per kv head over the ragged batch, the last one a single key; GQA, 4 query
    heads over 2 kv heads): the reference's values, and a second call the first's bits, each leaving its heads'
    span counters at 0 for the next (the last span to finish folds a head and resets its counter)."""
    from diffusers_trtllm.config import QuantConfig
    from diffusers_trtllm.kernels import triton_quant
    from diffusers_trtllm.kernels.reference import block_ids

    saved = triton_quant.V_STATS_ROWS
    triton_quant.V_STATS_ROWS = 16
    try:
        _check_quantize("int8", 1, 16, True)
        gen = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(sum(LENS_KV), heads, 64, generator=gen).half() for heads in (4, 2, 2))
        quant, layout = QuantConfig("int8", 1, 16, True), _layout(LENS_KV, LENS_KV)
        runs = [triton_quant.sage_quantize_triton(q, k, v, layout, quant) for _ in range(2)]
    finally:
        triton_quant.V_STATS_ROWS = saved
    assert not any(t.any() for t in triton_quant._TICKETS.values())
    q_used = block_ids(layout.cu_seqlens_q, layout.q_lens, 1)[0].unique()  # (the other scale slots are unwritten)
    k_used = block_ids(layout.cu_seqlens_kv, layout.kv_lens, 16)[0].unique()
    for st in runs:
        st.q_scale, st.k_scale = st.q_scale[:, q_used], st.k_scale[:, k_used]
    for name in ("q", "k", "vt", "q_scale", "k_scale", "v_scale", "v_mean", "k_mean"):
        assert torch.equal(getattr(runs[0], name).float(), getattr(runs[1], name).float()), name


def _assert_gaps_zero(got, layout, mma_key_order):
    """Columns of the transposed V that hold no key (between sequences, read by the masked last KV tile) are zeros."""
    from diffusers_trtllm.kernels.triton_quant import mma_key_column, vt_start

    used = torch.zeros(got.vt.shape[1], dtype=torch.bool)
    for b, (start, n) in enumerate(zip(layout.cu_seqlens_kv.tolist(), layout.kv_lens)):
        cols = torch.arange(n) + vt_start.fn(b, start)
        used[mma_key_column.fn(cols) if mma_key_order else cols] = True
    assert torch.all(got.vt[:, ~used].float() == 0), "gap columns not zero"


def _check_quantize_nonfinite_v(value, mma_key_order):
    """A NaN or inf in one channel of V makes that channel's scale NaN (attention's output there turns NaN, as
    torch's does); the gaps between sequences stay zero even in that channel (0 / NaN is NaN: the V tiles must
    write zeros there, not quantize them), and the other channels' scales are the reference's."""
    from diffusers_trtllm.config import QuantConfig
    from diffusers_trtllm.kernels.reference import sage_quantize
    from diffusers_trtllm.kernels.triton_quant import sage_quantize_triton

    gen = torch.Generator().manual_seed(3)
    lens = (33, 70)
    layout = _layout(lens, lens)
    q, k, v = (torch.randn(sum(lens), 2, 64, generator=gen).half() for _ in range(3))
    v[3, 0, 5] = value
    quant = QuantConfig("int8", 1, 16)
    got = sage_quantize_triton(q, k, v, layout, quant, mma_key_order=mma_key_order)
    ref = sage_quantize(q, k, v, layout.cu_seqlens_q, layout.cu_seqlens_kv, lens, lens, quant, smooth_v=True,
                        v_mean=got.v_mean)
    assert torch.isnan(got.v_scale[0, 5])
    finite = ~torch.isnan(ref.v_scale)
    assert torch.equal(got.v_scale[finite], ref.v_scale[finite]) and finite.sum() == finite.numel() - 1
    _assert_gaps_zero(got, layout, mma_key_order)


def _check_quantize_properties():
    """Hypothesis draws of ragged KV lengths (empty and short sequences, several V tiles of 64 columns,
    lengths off the 16-column grid), block sizes (K split per thread or not) and both key orders: bit-equal to
    the reference, gaps zero."""
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    @settings(derandomize=True, max_examples=8, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @example([5, 0, 130], (1, 16, False), False, True)  # a sequence shorter than a K block, an empty one
    @example([0, 17, 128], (4, 4, False), True, False)
    @example([130, 300], (1, 128, False), True, True)  # 128-key blocks: K tiles of 128 tokens, blocks cut short
    @example([3, 130, 261], (1, 128, True), False, True)  # split per thread: lanes with no key in a short block
    @given(st.lists(st.integers(0, 300), min_size=1, max_size=4).filter(any),
           st.sampled_from([(1, 16, False), (4, 4, False), (16, 1, False), (1, 128, False), (1, 16, True),
                            (1, 128, True)]), st.booleans(), st.booleans())
    def check(lens_kv, blocks, smooth_k, mma_key_order):
        lens_q = tuple(min(n, 40) for n in lens_kv)  # a sequence with no keys has no queries either
        q_block, k_block, per_thread = blocks
        _check_quantize("int8", q_block, k_block, smooth_k, lens_q, tuple(lens_kv), mma_key_order, per_thread)

    check()


def _check_attention(dtype, dim, kv_heads, dtype_qk, skip):
    from diffusers_trtllm.config import QuantConfig
    from diffusers_trtllm.kernels.reference import reference_attention
    from diffusers_trtllm.kernels.triton_attn import KernelConfig, triton_attention

    gen = torch.Generator().manual_seed(0)
    layout = _layout(LENS_Q, LENS_KV)
    q = _structured(LENS_Q, 4, dim, gen).to(dtype)
    k = _structured(LENS_KV, kv_heads, dim, gen).to(dtype)
    v = torch.randn(sum(LENS_KV), kv_heads, dim, generator=gen).to(dtype)
    quant = QuantConfig(dtype_qk, 4, 16) if dtype_qk else None
    factor = None if skip is None else skip * max(LENS_KV)
    kw = dict(softmax_scale=dim**-0.5, skip_factor=factor, quant=quant)
    res = triton_attention(q, k, v, layout, collect_stats=True, return_lse=True, config=KernelConfig(TILE, TILE, 4, 1),
                           **kw)
    ref = reference_attention(
        q, k, v, layout.cu_seqlens_q, layout.cu_seqlens_kv, layout.q_lens, layout.kv_lens,
        tile_q=TILE, tile_kv=TILE, smooth_v=True, **kw,
    )
    # Ring attention's log-sum-exp: natural log, [tokens, heads] float32, skipped tiles excluded.
    assert res.lse is not None and res.lse.shape == ref.lse.shape and res.lse.dtype == torch.float32
    lse_tol = 1e-4 if dtype == torch.float32 else 2e-3
    assert (res.lse - ref.lse).abs().max() < lse_tol, f"lse max abs error {(res.lse - ref.lse).abs().max():.3g}"
    assert res.total_tiles == ref.total_tiles
    assert res.skipped_tiles == ref.skipped_tiles, (res.skipped_tiles, ref.skipped_tiles)
    if skip is not None:
        assert ref.skipped_tiles > 0, "inputs must exercise the skip rule"
    # SAGE: a P value on an fp8 rounding boundary may round the other way (exp2 here, exp there), moving an
    # output by up to one e4m3 step (1/8) of that P times |V|; the mean error must stay at the reference's.
    err = (res.out.float() - ref.out.float()).abs()
    rel = (err.sum() / ref.out.float().abs().sum()).item()
    sage_max = float(v.float().abs().max()) / 8
    max_tol, rel_tol = (1e-4, 1e-5) if dtype == torch.float32 else (4e-3, 1e-3) if quant is None else (sage_max, 3e-3)
    assert err.max() < max_tol and rel < rel_tol, f"max abs error {err.max():.3g}, rel-L1 {rel:.3g}"


def _run_both(q, k, v, layout, dtype_qk, skip):
    """The kernel and the reference on the same packed inputs, 32 x 32 tiles."""
    from diffusers_trtllm.config import QuantConfig
    from diffusers_trtllm.kernels.reference import reference_attention
    from diffusers_trtllm.kernels.triton_attn import KernelConfig, triton_attention

    quant = QuantConfig(dtype_qk, 4, 16) if dtype_qk else None
    factor = None if skip is None else skip * layout.max_seqlen_kv
    kw = dict(softmax_scale=q.shape[-1] ** -0.5, skip_factor=factor, quant=quant)
    res = triton_attention(q, k, v, layout, collect_stats=True, config=KernelConfig(TILE, TILE, 4, 1), **kw)
    ref = reference_attention(q, k, v, layout.cu_seqlens_q, layout.cu_seqlens_kv, layout.q_lens, layout.kv_lens,
                              tile_q=TILE, tile_kv=TILE, smooth_v=True, **kw)
    return res, ref


#: Smaller shapes for the many extreme-value cases (still ragged, several KV tiles).
SMALL_Q, SMALL_KV = (20, 40), (30, 70)


def _check_magnitude(dtype, dtype_qk, skip, magnitude):
    """Finite inputs of any magnitude give finite outputs, close to the reference's (issue 13)."""
    gen = torch.Generator().manual_seed(2)
    layout = _layout(SMALL_Q, SMALL_KV)
    q = (torch.randn(sum(SMALL_Q), 2, 64, generator=gen) * magnitude).clamp(-6e4, 6e4).to(dtype)
    k = (torch.randn(sum(SMALL_KV), 1, 64, generator=gen) * magnitude).clamp(-6e4, 6e4).to(dtype)
    v = (torch.randn(sum(SMALL_KV), 1, 64, generator=gen) * magnitude).clamp(-6e4, 6e4).to(dtype)
    res, ref = _run_both(q, k, v, layout, dtype_qk, skip)
    out = res.out.float()
    assert torch.isfinite(ref.out.float()).all()
    assert torch.isfinite(out).all(), f"{int((~torch.isfinite(out)).sum())} of {out.numel()} outputs not finite"
    assert res.skipped_tiles == ref.skipped_tiles, (res.skipped_tiles, ref.skipped_tiles)
    rel = ((out - ref.out.float()).abs().sum() / ref.out.float().abs().sum()).item()
    assert rel < 5e-3, f"rel-L1 {rel:.3g} vs the reference"


def _check_nonfinite(dtype_qk, skip, tensor, value):
    """NaN/inf in an input reaches the output wherever the reference's (and torch's) output has it."""
    gen = torch.Generator().manual_seed(3)
    layout = _layout(SMALL_Q, SMALL_KV)
    q = _structured(SMALL_Q, 2, 64, gen).half()
    k = _structured(SMALL_KV, 1, 64, gen).half()
    v = torch.randn(sum(SMALL_KV), 1, 64, generator=gen).half()
    x = {"q": q, "k": k, "v": v}[tensor]
    x[SMALL_Q[0] + 30 if tensor == "q" else SMALL_KV[0] + 66, 0, 5] = value  # second sequence, last KV tile
    res, ref = _run_both(q, k, v, layout, dtype_qk, skip)
    bad_ref, bad = ~torch.isfinite(ref.out.float()), ~torch.isfinite(res.out.float())
    assert bad_ref.any(), "the reference must propagate the value"
    missing = bad_ref & ~bad
    assert not missing.any(), f"{int(missing.sum())} outputs finite where the reference's are not"
    if dtype_qk is None:  # dense: the same rows and heads; SAGE may spread over a quantization block
        assert torch.equal(bad, bad_ref)


def _check_properties():
    """Hypothesis draws (ragged lengths, GQA, dtypes, routes, thresholds) against the reference: few, derandomized."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(derandomize=True, max_examples=20, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(st.tuples(st.integers(1, 70), st.integers(1, 70)), min_size=1, max_size=2),
           st.integers(1, 2), st.integers(1, 2), st.sampled_from([torch.float16, torch.float32]),
           st.sampled_from([None, "int8", "fp8_e4m3"]), st.one_of(st.none(), st.floats(0.0, 0.5)),
           st.integers(0, 1000))
    def check(lens, kv_heads, group, dtype, dtype_qk, skip, seed):
        gen = torch.Generator().manual_seed(seed)
        lens_q, lens_kv = tuple(a for a, _ in lens), tuple(b for _, b in lens)
        q = _structured(lens_q, kv_heads * group, 64, gen).to(dtype)
        k = _structured(lens_kv, kv_heads, 64, gen).to(dtype)
        v = torch.randn(sum(lens_kv), kv_heads, 64, generator=gen).to(dtype)
        if dtype_qk is not None and min(lens_kv) < 16:
            return  # SAGE needs a whole K block per sequence (the dispatcher runs such calls unquantized)
        res, ref = _run_both(q, k, v, _layout(lens_q, lens_kv), dtype_qk, skip)
        assert res.total_tiles == ref.total_tiles
        assert res.skipped_tiles == ref.skipped_tiles, (res.skipped_tiles, ref.skipped_tiles)
        err = (res.out.float() - ref.out.float()).abs()
        assert err.max() < (1e-4 if dtype == torch.float32 and dtype_qk is None else 0.03), f"max abs error {err.max():.3g}"

    check()


CASES = {
    "max-nan-reduction": (_check_max_nan, ()),
    **{
        f"quantize-{d}-{qb}-{kb}-{'smooth' if sm else 'plain'}": (_check_quantize, (d, qb, kb, sm))
        for d in ("int8", "fp8_e4m3")
        for qb, kb, sm in ((1, 16, False), (4, 4, True), (16, 1, False))
    },
    # An empty KV sequence between two others: its gap is zeroed too (the previous one's last tile reads it).
    "quantize-int8-empty-kv-sequence": (_check_quantize, ("int8", 1, 16, False, (37, 0, 70), (45, 0, 100))),
    **{f"quantize-v-{value}-{'mma' if mma else 'plain'}-order": (_check_quantize_nonfinite_v, (value, mma))
       for value in (math.nan, math.inf) for mma in (False, True)},
    "quantize-hypothesis-vs-reference": (_check_quantize_properties, ()),
    "kv-stats": (_check_kv_stats, ()),
    "quantize-many-spans-twice": (_check_quantize_many_spans_twice, ()),
    "dense-fp32-d64-gqa": (_check_attention, (torch.float32, 64, 2, None, None)),
    "dense-fp16-d128": (_check_attention, (torch.float16, 128, 4, None, None)),
    "dense-fp16-d64-skip": (_check_attention, (torch.float16, 64, 4, None, 0.05)),
    "sage-int8-d64": (_check_attention, (torch.float16, 64, 2, "int8", None)),
    "sage-int8-d128-skip": (_check_attention, (torch.float16, 128, 4, "int8", 0.05)),
    "sage-fp8-d64-skip": (_check_attention, (torch.float16, 64, 4, "fp8_e4m3", 0.05)),
    "sage-fp8-d128": (_check_attention, (torch.float16, 128, 2, "fp8_e4m3", None)),
    "hypothesis-vs-reference": (_check_properties, ()),
    **{
        f"magnitude-{str(dt)[6:]}-{qk or 'dense'}-{'skip' if sk else 'noskip'}-{mag:g}": (
            _check_magnitude, (dt, qk, sk, mag))
        for dt, mag, routes in (
            (torch.float16, 1e2, (("int8", None),)),
            (torch.float16, 1e4, ((None, None), ("int8", None), ("fp8_e4m3", 0.05), (None, 0.05))),
            (torch.float16, 6e4, ((None, None), ("int8", 0.05), ("fp8_e4m3", None))),
            (torch.float32, 1e4, ((None, None), ("int8", None))),
        )
        for qk, sk in routes
    },
    **{
        f"nonfinite-{qk or 'dense'}-{'skip' if sk else 'noskip'}-{t}-{val}": (_check_nonfinite, (qk, sk, t, val))
        for qk, sk, t, val in (
            (None, None, "q", math.nan), (None, 0.05, "k", math.nan), ("int8", None, "q", math.nan),
            ("int8", None, "k", math.inf), ("int8", None, "v", math.nan), ("fp8_e4m3", 0.05, "k", math.nan),
            ("fp8_e4m3", None, "q", math.nan),
        )
    },
}


def _run_all() -> None:
    """Each case's result as one JSON line when it ends: a run cut short still reports the cases it finished."""
    import traceback

    for name, (fn, args) in CASES.items():
        try:
            fn(*args)
            error = None
        except Exception:  # noqa: BLE001 - reported to the parent
            error = traceback.format_exc(limit=3)
        print(json.dumps({"case": name, "error": error}), flush=True)


# ---- the pytest side ---------------------------------------------------------------------------

#: The cases' child (this file as a script), started with the session (``background_jobs``).
INTERPRETER = BackgroundJob(
    lambda workdir: None if interpreter_missing() else [sys.executable, __file__], ("test_kernel_under_interpreter",),
    cwd=ROOT,
    env=dict(os.environ, TRITON_INTERPRET="1",
             PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])))
#: The whole child run's limit: it took 35 s on an idle 2-core machine, 55 s with the other core busy (5 minutes
#: when the interpreter reduced element by element).
INTERPRETER_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def interpreted():
    missing = interpreter_missing()
    if missing:
        pytest.skip(missing)
    run = INTERPRETER.result(INTERPRETER_TIMEOUT_S)
    failure = (f"cut off {INTERPRETER_TIMEOUT_S} s after it started" if run.returncode is None
               else f"exit {run.returncode}: {run.stderr[-3000:]}" if run.returncode else None)
    results = {r["case"]: r for r in map(json.loads, (ln for ln in run.stdout.splitlines() if ln.startswith("{")))}
    return results, failure


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_under_interpreter(interpreted, case):
    results, failure = interpreted
    assert case in results, f"the interpreter run ended before this case ({failure})"
    assert results[case]["error"] is None, results[case]["error"]


def test_route_capabilities_and_reasons(monkeypatch):
    from diffusers_trtllm.config import QuantConfig
    from diffusers_trtllm.kernels import triton_attn
    from diffusers_trtllm.routing.registry import AttentionCall, ROUTE_MODULES, get_route

    assert ROUTE_MODULES.index("triton_attn") < ROUTE_MODULES.index("sdpa")
    assert ROUTE_MODULES.index("triton_attn") > max(ROUTE_MODULES.index(m) for m in ("trtllm_gen", "fa3", "fmha_v2"))
    route = get_route("triton")
    q = torch.zeros(64, 2, 128, dtype=torch.bfloat16)
    call = AttentionCall(q, q, q, _layout((64,), (64,)), softmax_scale=0.1, quant=QuantConfig("fp8_e4m3"))
    assert any("cuda" in r for r in route.not_supported_reasons(call))  # a CPU tensor
    assert route.caps.min_sm == 80 and route.caps.skip_softmax and route.caps.head_dims == {64, 128}
    monkeypatch.setattr(triton_attn, "device_sm", lambda device: 86)
    assert any("SM >= 89" in r for r in route.extra_reasons(call))
    int8 = AttentionCall(q, q, q, call.layout, softmax_scale=0.1, quant=QuantConfig("int8"))
    assert route.extra_reasons(int8) == []
    monkeypatch.setattr(triton_attn, "_TRITON_MISSING", "needs the triton package")
    assert route.extra_reasons(int8) == ["needs the triton package"]


def test_rejects_unsupported_head_dim():
    pytest.importorskip("triton")
    from diffusers_trtllm.kernels.triton_attn import triton_attention

    q = torch.zeros(8, 1, 96, dtype=torch.float16)
    with pytest.raises(ValueError, match="head dim 64 or 128"):
        triton_attention(q, q, q, _layout((8,), (8,)), softmax_scale=0.1)


@pytest.mark.parametrize("sm,dtype_qk,mma_key_order,smooth_k,k_block,per_thread", [
    (90, "int8", True, False, 128, True), (90, "int8", True, False, 128, False), (90, "int8", True, False, 16, False),
    (90, "fp8_e4m3", False, True, 16, False), (80, "int8", False, False, 16, False)])
def test_quantizer_compiles_for_the_gpu(sm, dtype_qk, mma_key_order, smooth_k, k_block, per_thread):
    """The quantizer's launches through Triton's whole GPU pipeline (to PTX and cubin) without a GPU: the
    interpreter above checks its values, not that its layouts (the V tiles' fp8 transpose
    and masked stores) lower for a real target. SM80 has no fp8: V is kept in fp16 there.

    Compiled with the specialization a launch gets (pointers and integers divisible by 16 marked so), every
    store of quantized values is a 16-byte vector: a V tile that stored its columns in the key order
    scattered single bytes and ran three times slower on the H200 (docs/design.md, "The quantizer")."""
    pytest.importorskip("triton")
    from diffusers_trtllm.kernels import triton_quant

    native = sm >= 89
    qk = torch.int8 if dtype_qk == "int8" else torch.float8_e4m3fn
    bf16, f32, i32 = (torch.empty(16, dtype=t) for t in (torch.bfloat16, torch.float32, torch.int32))
    quantized, vt = torch.empty(16, dtype=qk), torch.empty(16, dtype=torch.float8_e4m3fn if native else torch.float16)
    block_k = max(triton_quant.QUANT_BLOCK_T, k_block)
    common = dict(HKV=2, D=128, BLOCK_T=triton_quant.QUANT_BLOCK_T, QMAX=127 if dtype_qk == "int8" else 448,
                  IS_INT8=dtype_qk == "int8", NATIVE=native, SMOOTH_K=smooth_k)
    first = (triton_quant._q_and_stats_kernel,
             (bf16, bf16, bf16, quantized, f32, f32, i32, i32, 7, 4, 2, 512, 512, 2, 1, 512, 128, 256, 128, 256, 128),
             dict(common, H=4, Q_BS=1, STATS_BLOCK_T=triton_quant.V_STATS_BLOCK_T,
                  STATS_STAGES=triton_quant.V_STATS_STAGES, DO_Q=True), triton_quant.QUANT_WARPS)
    launches = [first] + [
        (triton_quant._kv_quant_kernel, (bf16, bf16, quantized, vt, f32, f32, i32, 7, 2, 4, 512, 2, 256, 128, 256, 128),
         dict(common, BLOCK_K=block_k, K_BS=k_block, MMA_KEY_ORDER=mma_key_order, K_PER_THREAD=per_thread,
              DO_K="k" in parts, DO_V="v" in parts), triton_quant.launch_warps(parts, block_k))
        for parts in {*triton_quant.QUANT_LAUNCHES, *triton_quant.QUANT_SHORT_LAUNCHES}]  # each launch it makes
    for i, (kernel, args, consts, warps) in enumerate(launches):
        compiled = compiled_for(kernel, args, consts, sm, num_warps=warps, **triton_quant._UNFUSED)
        ptx = compiled.asm["ptx"]
        assert compiled.asm["cubin"] and "st.global" in ptx
        stores = collections.Counter(re.findall(r"st\.global(?:\.v\d)?\.b\d+", ptx))
        assert set(stores) <= {"st.global.v4.b32", "st.global.b32"}, stores  # vectors, and the scales (fp32)
        if i == 0:  # a statistics span's ticket publishes its partials, and the folding program's acquires them all
            assert "atom.global.gpu.acq_rel.add" in ptx


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (pytest does this for you)")
    import triton_interpreter

    triton_interpreter.vectorize_reductions()
    _run_all()

