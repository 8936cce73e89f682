"""The ``sage-sm90`` CUDA kernel on an H100/H200: int8 SAGE with and without skip-softmax against the
reference (same quantization, same 64 x 128 tiles), over the ragged batches of the ``triton`` route's GPU
tests; head dims 64 and 128, GQA, fp16, extreme magnitudes and NaN; the log-sum-exp, alone and merging two KV
shards; the persistent kernel's loop over work tiles (more tiles than SMs, few CTAs, empty and one-token
sequences) against the reference and against one CTA per tile, and CTAs of one consumer warpgroup (two an SM)
against CTAs of two; the kernel built by NVRTC and by nvcc, a first call that builds its one variant and says so,
and the default's error on keys with a channel mean."""

from __future__ import annotations

import functools
import logging
import os

import pytest
import torch

from conftest import rel_l1, requires_cuda
from diffusers_trtllm.config import QuantConfig
from test_triton_attn_gpu import (MAGNITUDES, NONFINITE, ROUTES, _inputs, _reference, _structured, check_coherent_values,
                                  check_extreme_magnitudes, check_nonfinite_propagation, check_tile_counts)

pytestmark = [pytest.mark.gpu, requires_cuda]

BUILDS = {"default": (), "pingpong": ("SAGE_SM90_PINGPONG=1",), "two_stages": ("SAGE_SM90_STAGES=2",),
          "serial": ("SAGE_SM90_OVERLAP=0",), "fp32_poly": ("SAGE_SM90_HALF_POLY=0",),
          "serial_fp32_poly": ("SAGE_SM90_OVERLAP=0", "SAGE_SM90_HALF_POLY=0"),
          # The persistent kernel (issue 57; not the default, measured slower), with two Q buffers or one, and with
          # six stages.
          "persistent": ("SAGE_SM90_PERSISTENT=1",),
          "one_q_buffer": ("SAGE_SM90_PERSISTENT=1", "SAGE_SM90_Q_BUFFERS=1"),
          "six_stages": ("SAGE_SM90_PERSISTENT=1", "SAGE_SM90_STAGES=6"),  # (one Q buffer: two do not fit beside six)
          # CTAs of 64 query rows, one consumer warpgroup, two an SM (three stages), and the same persistent (head dim
          # 128 with one Q buffer: two do not fit beside three stages in half the SM's shared memory).
          "one_consumer": ("SAGE_SM90_CONSUMERS=1",),
          "one_consumer_persistent": ("SAGE_SM90_CONSUMERS=1", "SAGE_SM90_PERSISTENT=1"),
          # The output stored from the registers, as the one-consumer build must (the default stages it in shared
          # memory).
          "registers_out": ("SAGE_SM90_STAGE_OUT=0",),
          # O rescaled only where a row's max passed the exponent's by more than 2 (log2 units; issue 57)
          "rescale_slack": ("SAGE_SM90_RESCALE_SLACK=2",)}


@pytest.fixture(autouse=True)
def _hopper_with_nvcc():
    from diffusers_trtllm.kernels.sage_sm90 import sage_sm90_missing

    if sage_sm90_missing():
        pytest.skip(sage_sm90_missing())
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sage-sm90 kernel is written for sm_90")


def _attention(*args, **kw):
    from diffusers_trtllm.kernels.sage_sm90 import sage_sm90_attention

    return sage_sm90_attention(*args, **kw)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("skip", [None, 0.02])
@pytest.mark.parametrize("dim,kv_heads,blocks", [(128, 4, (1, 16, False)), (64, 8, (1, 16, True)), (128, 2, (4, 4, False)),
                                                 (128, 8, (16, 1, False)), (128, 4, (1, 128, False)),
                                                 (64, 8, (4, 128, False)), (128, 4, (1, 128, True)), (64, 2, (4, 128, True))])
def test_int8_sage_matches_reference(dim, kv_heads, blocks, skip, build):
    """``blocks``: Q block, K block, K split per thread (the reference told the same: nothing left to a route)."""
    q, k, v, layout = _inputs(dim, kv_heads=kv_heads)
    q_block, k_block, per_thread = blocks
    quant = QuantConfig("int8", q_block, k_block, k_per_thread=per_thread)
    factor = None if skip is None else skip * layout.max_seqlen_kv
    res = _attention(q, k, v, layout, softmax_scale=dim**-0.5, skip_factor=factor, quant=quant,
                     collect_stats=True, defines=BUILDS[build])
    ref = _reference(q, k, v, layout, skip_factor=factor, quant=quant, tile_q=64, tile_kv=128)
    check_tile_counts(res, ref, skip)
    assert rel_l1(res.out, ref.out) < 1.5e-2
    assert rel_l1(res.out, _reference(q, k, v, layout).out) < 0.06


@pytest.mark.parametrize("build", ["default", "one_consumer", "one_consumer_persistent"])
@pytest.mark.parametrize("dim", [64, 128])
def test_ctas_an_sm_are_what_the_host_counts(dim, build):
    """The driver fits as many CTAs of the build on an SM as the host's grid counts on (two of one consumer: the
    registers of ``__launch_bounds__`` and the shared memory the source sized for it), at the launch's shared memory."""
    import ctypes

    from diffusers_trtllm.kernels import cuda_jit, sage_sm90

    kernel = sage_sm90._kernel(torch.device("cuda", torch.cuda.current_device()), dim, torch.bfloat16, 128, True,
                               BUILDS[build])
    cta = sage_sm90._cta(BUILDS[build])
    blocks = ctypes.c_int()
    cuda_jit._check(cuda_jit._driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), ctypes.c_void_p(kernel.function), ctypes.c_int(cta.threads),
        ctypes.c_size_t(kernel.shared_bytes)), "occupancy")
    assert blocks.value == cta.per_sm


@pytest.mark.parametrize("k_block,per_thread", [(16, False), (128, False), (128, True)])
def test_fp16_and_smooth_k(k_block, per_thread):
    q, k, v, layout = (x.half() if torch.is_tensor(x) else x for x in _inputs(128, kv_heads=4))
    quant = QuantConfig("int8", 1, k_block, smooth_k=True, k_per_thread=per_thread)
    res = _attention(q, k, v, layout, softmax_scale=128**-0.5, quant=quant)
    assert res.out.dtype == torch.float16
    assert rel_l1(res.out, _reference(q, k, v, layout, quant=quant, tile_q=64, tile_kv=128).out) < 1.5e-2


@pytest.mark.parametrize("k_block,per_thread", [(16, False), (128, False), (128, True)])
def test_coherent_values_over_long_keys(k_block, per_thread):
    check_coherent_values(_attention, k_block, per_thread)


def _int8(smooth_k: bool) -> QuantConfig:
    """int8 SAGE with this kernel's K blocks, told to the reference too."""
    from diffusers_trtllm.kernels.sage_sm90 import K_BLOCK, K_PER_THREAD

    return QuantConfig("int8", smooth_k=smooth_k).with_k_block(K_BLOCK, K_PER_THREAD)


@pytest.mark.parametrize("smooth_k", [True, False])
@pytest.mark.parametrize("skip", [None, 0.02])
def test_lse_matches_the_reference(skip, smooth_k):
    """The log-sum-exp ring attention merges by, held as the triton route's is
    (``test_triton_attn_gpu.py::test_lse_matches_reference``): against the unquantized log-sum-exp, the kernel's
    error at most 10% above the emulation's own (with smooth_k, K's mean added back to both)."""
    q, k, v, layout = _inputs(128, kv_heads=4)
    quant = _int8(smooth_k)
    factor = None if skip is None else skip * layout.max_seqlen_kv
    res = _attention(q, k, v, layout, softmax_scale=128**-0.5, skip_factor=factor, quant=quant, collect_stats=True,
                     return_lse=True)
    ref = _reference(q, k, v, layout, skip_factor=factor, quant=quant, tile_q=64, tile_kv=128)
    assert res.lse.shape == (q.shape[0], q.shape[1]) and res.lse.dtype == torch.float32
    check_tile_counts(res, ref, skip)
    exact = _reference(q, k, v, layout, skip_factor=factor, tile_q=64, tile_kv=128).lse
    ours, emulated = (res.lse - exact).abs(), (ref.lse - exact).abs()
    assert ours.mean() <= 1.1 * emulated.mean() + 1e-4, (ours.mean(), emulated.mean())
    assert torch.quantile(ours.flatten(), 0.999) <= 1.1 * torch.quantile(emulated.flatten(), 0.999) + 1e-3


@pytest.mark.parametrize("smooth_k", [True, False])
@pytest.mark.parametrize("threshold", [None, 0.02])
def test_two_kv_shards_merged_by_lse_are_one_call(threshold, smooth_k):
    """Ring attention on one GPU: one sequence's keys in two shards, each run with its log-sum-exp (lambda the
    whole sequence's, as ``run_attention(kv_shards=2)`` passes it) and merged as Diffusers merges. Each shard is
    quantized on its own (V's scales, K's mean), so the merge is held to the unquantized attention: its error
    at most 10% above one call's, the output's and the log-sum-exp's."""
    from diffusers_trtllm.bench.ring_skip import merge_by_lse
    from diffusers_trtllm.layout import PackedLayout

    tokens, shard = 4096, 2048
    q, k = _structured((tokens,), 4, 128, 0), _structured((tokens,), 4, 128, 1)
    v = torch.randn(tokens, 4, 128, device="cuda", dtype=torch.bfloat16)

    def run(keys, values, **kw):
        layout = PackedLayout.dense(1, tokens, keys.shape[0], "cuda")
        factor = None if threshold is None else threshold * keys.shape[0]
        return _attention(q, keys, values, layout, softmax_scale=128**-0.5, skip_factor=factor, quant=_int8(smooth_k),
                          return_lse=True, **kw)

    one = run(k, v)
    out, lse = merge_by_lse([(res.out, res.lse) for res in (run(k[i:i + shard], v[i:i + shard])
                                                            for i in range(0, tokens, shard))])
    exact = _reference(q, k, v, PackedLayout.dense(1, tokens, tokens, "cuda"), skip_factor=None if threshold is None
                       else threshold * tokens, tile_q=64, tile_kv=128)
    assert rel_l1(out, exact.out) <= 1.1 * rel_l1(one.out, exact.out) + 1e-3
    assert (lse - exact.lse).abs().mean() <= 1.1 * (one.lse - exact.lse).abs().mean() + 1e-4


def test_zero_skip_factor_skips_nothing():
    q, k, v, layout = _inputs(128, kv_heads=4)
    res = _attention(q, k, v, layout, softmax_scale=128**-0.5, skip_factor=0.0, quant=QuantConfig("int8"),
                     collect_stats=True)
    assert res.skipped_tiles == 0


@pytest.mark.parametrize("skip", [None, 0.02])
def test_a_call_never_waits_on_the_host(skip):
    """Short sequences (Flux's) are bound by a call's fixed cost: no device-to-host copy or sync in one
    (issue 21), the quantizer's launch included."""
    q, k, v, layout = _inputs(128, kv_heads=4)
    kw = dict(softmax_scale=128**-0.5, quant=QuantConfig("int8"),
              skip_factor=None if skip is None else skip * layout.max_seqlen_kv)
    _attention(q, k, v, layout, **kw)  # the first call loads the cubin
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _attention(q, k, v, layout, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")


INT8_ROUTES = [(qk, skip) for qk, skip in ROUTES if qk == "int8"]


#: (build, K split per thread): the split on the default build only (it changes the producer's staging alone).
EXTREME_CASES = [("default", False), ("serial_fp32_poly", False), ("default", True), ("rescale_slack", False)]


@pytest.mark.parametrize("build,per_thread", EXTREME_CASES)
@pytest.mark.parametrize("dtype_qk,skip", INT8_ROUTES)
@pytest.mark.parametrize("dtype,magnitude", MAGNITUDES)
def test_extreme_magnitudes_stay_finite(dtype, magnitude, dtype_qk, skip, build, per_thread):
    check_extreme_magnitudes(functools.partial(_attention, defines=BUILDS[build]), 64, dtype, magnitude, dtype_qk, skip,
                             per_thread)


@pytest.mark.parametrize("build,per_thread", EXTREME_CASES)
@pytest.mark.parametrize("dtype_qk,skip", INT8_ROUTES)
@pytest.mark.parametrize("tensor,value", NONFINITE)
def test_nonfinite_inputs_propagate(tensor, value, dtype_qk, skip, build, per_thread):
    check_nonfinite_propagation(functools.partial(_attention, defines=BUILDS[build]), 64, tensor, value, dtype_qk, skip,
                                per_thread)


def test_auto_takes_it_for_int8_sage_at_every_length():
    """On Hopper ``auto`` runs int8 SAGE on this kernel at every length (routing/order.py, issue 57)."""
    import math

    from diffusers_trtllm.layout import PackedLayout
    from diffusers_trtllm.routing import AttentionCall, select_route

    def call(tokens):
        q, k, v = (torch.randn(tokens, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        layout = PackedLayout.dense(1, tokens, tokens, "cuda")
        return AttentionCall(q, k, v, layout, softmax_scale=128**-0.5, quant=QuantConfig("int8"))

    long_call = call(20000)
    assert select_route(long_call).name == "sage-sm90"
    assert select_route(call(4608)).name == "sage-sm90"
    res = select_route(long_call).run(long_call)
    ref = _reference(long_call.q.float(), long_call.k.float(), long_call.v.float(), long_call.layout).out
    assert res.route == "sage-sm90" and rel_l1(res.out, ref) < 0.06 and not math.isnan(rel_l1(res.out, ref))


def _variant_call(q, k, v, layout, quant):
    from diffusers_trtllm.kernels import sage_sm90

    return sage_sm90.sage_sm90_attention(q, k, v, layout, softmax_scale=q.shape[-1] ** -0.5, quant=quant).out


def test_nvrtc_and_nvcc_builds_compute_the_same():
    """The library builds with NVRTC (torch's CUDA wheels' library) unless DIFFUSERS_TRTLLM_NVCC names an nvcc:
    both kernels match the reference, and each other to the bit (same source, same arithmetic)."""
    from diffusers_trtllm.kernels import cuda_jit

    q, k, v, layout = _inputs(128, kv_heads=4)
    quant = QuantConfig("int8")
    ref = _reference(q, k, v, layout, quant=quant.with_k_block(128, True), tile_q=64, tile_kv=128).out
    nvrtc = cuda_jit.find_compiler()
    assert nvrtc is not None and nvrtc.name == "nvrtc", "torch's CUDA wheels bring NVRTC: the library's compiler"
    outs = {"nvrtc": _variant_call(q, k, v, layout, quant)}
    nvcc = cuda_jit.find_nvcc()
    if nvcc is not None:
        os.environ["DIFFUSERS_TRTLLM_NVCC"] = nvcc
        try:
            assert cuda_jit.find_compiler().name == "nvcc"
            outs["nvcc"] = _variant_call(q, k, v, layout, quant)
        finally:
            del os.environ["DIFFUSERS_TRTLLM_NVCC"]
    for name, out in outs.items():
        assert rel_l1(out, ref) < 1.5e-2, name
    if "nvcc" in outs:
        assert torch.equal(outs["nvcc"], outs["nvrtc"])


def test_first_call_builds_only_its_variant_and_says_so(tmp_path, monkeypatch, caplog):
    """A cold cache: the call builds the one entry point it needs (not all 32) and logs it at WARNING level,
    naming the kernel and the cache folder; the next call builds nothing."""
    from diffusers_trtllm.kernels import sage_sm90

    monkeypatch.setenv("DIFFUSERS_TRTLLM_CACHE", str(tmp_path))
    sage_sm90.sage_sm90_cubin.cache_clear()
    q, k, v, layout = _inputs(128, kv_heads=4)
    with caplog.at_level(logging.WARNING):
        _variant_call(q, k, v, layout, QuantConfig("int8"))
    built = list((tmp_path / "cubin").glob("*.cubin"))
    assert len(built) == 1
    notes = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "building" in r.getMessage()]
    assert len(notes) == 1 and "sage_sm90_d128_bf16_k128" in notes[0] and str(tmp_path) in notes[0]
    caplog.clear()
    sage_sm90.sage_sm90_cubin.cache_clear()
    _variant_call(q, k, v, layout, QuantConfig("int8"))
    assert not [r for r in caplog.records if "building" in r.getMessage()]
    sage_sm90.sage_sm90_cubin.cache_clear()


def _keys_with_a_channel_mean(k_mean: float):
    from diffusers_trtllm.bench.inputs import Shape, structured_qkv
    from diffusers_trtllm.layout import PackedLayout

    shape = Shape("k_mean", 1, 8192, 4, 128, (8, 32, 32))
    q, k, v = (x[0].contiguous() for x in structured_qkv(shape, 0.5, device="cuda", k_mean=k_mean, v_mean=1.0))
    return q, k, v, PackedLayout.dense(1, shape.tokens, shape.tokens, "cuda")


@pytest.mark.parametrize("k_mean", [0.0, 4.0])
def test_default_int8_is_as_accurate_as_sageattention2_on_keys_with_a_channel_mean(k_mean):
    """Trained models' keys carry a per-channel mean; ``smooth_k`` (the default) takes it off before int8. On
    such keys the default's error is far below the unsmoothed kernel's and no higher than SageAttention2's
    (where it is installed); on zero-mean keys smoothing costs nothing."""
    q, k, v, layout = _keys_with_a_channel_mean(k_mean)
    dense = _reference(q.float(), k.float(), v.float(), layout).out
    default = rel_l1(_variant_call(q, k, v, layout, QuantConfig("int8")), dense)
    unsmoothed = rel_l1(_variant_call(q, k, v, layout, QuantConfig("int8", smooth_k=False)), dense)
    assert default < 0.05
    assert default <= unsmoothed * (1.02 if k_mean == 0 else 0.9), (default, unsmoothed)
    try:
        from sageattention import sageattn
    except ImportError:
        return
    theirs = sageattn(q[None], k.clone()[None], v[None], tensor_layout="NHD", is_causal=False, sm_scale=128**-0.5)[0]
    assert default <= rel_l1(theirs, dense) * 1.02, (default, rel_l1(theirs, dense))


# ---- the persistent kernel (issue 57): one CTA per SM looping over the work tiles; CTAs of one consumer ---------

#: Ragged batches with sequences the schedule must pass over (no queries; no queries nor keys) and one-token ones,
#: beside long ones: (query lengths, key lengths).
RAGGED_EDGES = {
    "zero_and_one_token": ((0, 1, 3000, 1, 0, 700, 129), (0, 1, 2500, 300, 64, 700, 1)),
    "one_token_first": ((1, 2049, 0, 128, 1500), (2500, 1, 77, 128, 1500)),  # (2049 queries, one key)
}


def _ragged(lens_q, lens_kv, dim, heads=8, kv_heads=2, seed=0):
    from test_triton_attn_gpu import _layout

    q = _structured(lens_q, heads, dim, seed)
    k = _structured(lens_kv, kv_heads, dim, seed + 1)
    v = torch.randn(sum(lens_kv), kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    return q, k, v, _layout(lens_q, lens_kv)


def _check_against_reference(q, k, v, layout, quant, skip, defines) -> None:
    """One call (skip counted, log-sum-exp returned) of the build ``defines``: its output, skipped tiles and
    log-sum-exp held to the reference's (``skip``: the threshold over the longest keys, None for none)."""
    factor = None if skip is None else skip * layout.max_seqlen_kv
    res = _attention(q, k, v, layout, softmax_scale=q.shape[-1]**-0.5, skip_factor=factor, quant=quant,
                     collect_stats=True, return_lse=True, defines=defines)
    ref = _reference(q, k, v, layout, skip_factor=factor, quant=quant, tile_q=64, tile_kv=128)
    check_tile_counts(res, ref, skip)
    assert rel_l1(res.out, ref.out) < 1.5e-2
    _check_lse(res, ref, q, k, v, layout, factor)


def _check_lse(res, ref, q, k, v, layout, factor) -> None:
    """As test_lse_matches_the_reference: the kernel's error against the unquantized log-sum-exp at most 10% above
    the emulation's own."""
    exact = _reference(q, k, v, layout, skip_factor=factor, tile_q=64, tile_kv=128).lse
    ours, emulated = (res.lse - exact).abs(), (ref.lse - exact).abs()
    assert ours.mean() <= 1.1 * emulated.mean() + 1e-4, (ours.mean(), emulated.mean())


@pytest.mark.parametrize("build", ["default", "one_consumer", "one_consumer_persistent", "rescale_slack"])
@pytest.mark.parametrize("skip", [None, 0.02])
@pytest.mark.parametrize("dim,kv_heads,blocks", [(128, 2, (1, 128, True)), (64, 2, (1, 16, False)),
                                                 (128, 8, (4, 4, False)), (64, 8, (1, 1, False))])
@pytest.mark.parametrize("lens", list(RAGGED_EDGES))
def test_ragged_batches_with_empty_and_one_token_sequences(lens, dim, kv_heads, blocks, skip, build):
    """Sequences without queries (with or without keys) have no work tiles and one-token sequences one each, in
    between long ones: the persistent kernel's producer and consumers agree on every tile's KV tiles (a disagreement
    hangs the ring), and the output, the skipped tiles and the log-sum-exp are the reference's."""
    q, k, v, layout = _ragged(*RAGGED_EDGES[lens], dim, kv_heads=kv_heads)
    q_block, k_block, per_thread = blocks
    quant = QuantConfig("int8", q_block, k_block, k_per_thread=per_thread)
    _check_against_reference(q, k, v, layout, quant, skip, BUILDS[build])


@pytest.mark.parametrize("ctas", [1, 3, 7])
@pytest.mark.parametrize("build", ["persistent", "pingpong", "serial", "one_q_buffer", "two_stages", "one_consumer"])
@pytest.mark.parametrize("skip", [None, 0.02])
def test_few_ctas_loop_over_many_work_tiles(skip, build, ctas, monkeypatch):
    """A grid of 1, 3 or 7 SMs' CTAs (the SM count the host sees, patched; two CTAs an SM with one consumer): each
    CTA runs tens to hundreds of work tiles of the triton tests' ragged batch (248 in all), so the ring's stages and
    phases and the Q buffers' run on over many tiles of different lengths; GQA and skip counts held to the
    reference."""
    from diffusers_trtllm.kernels import sage_sm90

    monkeypatch.setattr(sage_sm90, "_sm_count", lambda index: ctas)
    q, k, v, layout = _inputs(128, kv_heads=4)
    quant = QuantConfig("int8", 1, 128, k_per_thread=True)
    defines = tuple(dict.fromkeys((*BUILDS["persistent"], *BUILDS[build])))
    _check_against_reference(q, k, v, layout, quant, skip, defines)


@pytest.mark.parametrize("build", ["default", "persistent", "one_consumer", "one_consumer_persistent"])
@pytest.mark.parametrize("skip", [None, 0.02])
@pytest.mark.parametrize("dim,kv_heads", [(128, 24), (128, 8), (64, 6)])
def test_more_work_tiles_than_sms(dim, kv_heads, skip, build):
    """4 sequences x 24 heads x 4608 tokens (Flux 1024² at batch 4): 3,456 work tiles of 36 KV tiles, about 26 per
    CTA on an H100; GQA; the output, skipped tiles and log-sum-exp against the reference."""
    lens = (4608,) * 4
    q, k, v, layout = _ragged(lens, lens, dim, heads=24, kv_heads=kv_heads)
    _check_against_reference(q, k, v, layout, _int8(smooth_k=True), skip, BUILDS[build])


@pytest.mark.parametrize("skip", [None, 0.02])
@pytest.mark.parametrize("case", ["flux_batch4", "zero_and_one_token", "one_token_first"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("builds", [("persistent", "default"), ("one_consumer", "default"),
                                    ("one_consumer_persistent", "one_consumer"), ("registers_out", "default")])
def test_builds_compute_what_their_baseline_does(builds, dim, case, skip):
    """The persistent kernel (SAGE_SM90_PERSISTENT=1) and one CTA per work tile run the same arithmetic on every
    tile, in another order, and so do CTAs of one consumer and of two, and outputs stored from the registers or through
    shared memory: the outputs and log-sum-exps agree to rounding
    (bit for bit where ptxas schedules the two alike) and the skipped tiles to a borderline tile or two."""
    lens_q, lens_kv = ((4608,) * 4, (4608,) * 4) if case == "flux_batch4" else RAGGED_EDGES[case]
    q, k, v, layout = _ragged(lens_q, lens_kv, dim, heads=24 if case == "flux_batch4" else 8,
                              kv_heads=8 if case == "flux_batch4" else 2)
    quant = _int8(smooth_k=True)
    factor = None if skip is None else skip * layout.max_seqlen_kv
    runs = [_attention(q, k, v, layout, softmax_scale=dim**-0.5, skip_factor=factor, quant=quant, collect_stats=True,
                       return_lse=True, defines=BUILDS[name]) for name in builds]
    build, baseline = runs
    assert build.total_tiles == baseline.total_tiles
    if skip is not None:
        assert abs(build.skipped_tiles - baseline.skipped_tiles) <= 2
    assert rel_l1(build.out, baseline.out) < 1e-3
    assert torch.isfinite(build.lse).all() and (build.lse - baseline.lse).abs().max() < 1e-3
