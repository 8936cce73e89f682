"""GPU tests of the Hopper routes against the reference, on ragged batches packed by the layout module.

``fmha-v2`` dense and skip-softmax, ``fa3`` dense; the log-sum-exp of ``fa3``, ``fmha-v2`` and ``fmha-v2-fp8``. Inputs come from the
benchmark's structured generator, so skip-softmax has tiles to skip. The
reference runs with fmha-v2's tiles (64 query rows x its KV step).
"""

from __future__ import annotations

import pytest
import torch

from conftest import cosine, rel_l1, requires_cuda
from diffusers_trtllm import PackedLayout, SkipSoftmaxConfig, run_attention
from diffusers_trtllm.bench.inputs import holed_batch
from diffusers_trtllm.kernels.fmha_v2 import Q_STEP, kv_step
from diffusers_trtllm.kernels.reference import reference_attention
from diffusers_trtllm.routing.registry import AttentionCall, device_sm, get_route

pytestmark = [pytest.mark.gpu, requires_cuda]

HEADS, DIM, SEQ = 4, 128, 1536
#: Valid key counts per batch row (padding in the middle of each row, as Qwen-Image has).
KV_VALID = (1536, 1000, 700)


def _hopper_route(name: str, **call) -> None:
    if device_sm(torch.device("cuda")) != 90:
        pytest.skip("needs an SM90 GPU (H100/H200)")
    x = torch.zeros(8, 1, DIM, device="cuda", dtype=torch.bfloat16)
    reasons = get_route(name).not_supported_reasons(AttentionCall(x, x, x, PackedLayout.dense(1, 8, 8, "cuda"), 0.1, **call))
    if reasons:
        pytest.skip(f"{name} cannot run here: {reasons}")


def _ragged_inputs(locality: float = 0.5, dim: int = DIM, queries: str = "valid"):
    """Three rows with a hole of padded keys in the middle of each (``bench.inputs.holed_batch``).

    ``queries``: ``"valid"`` keeps the queries at the valid key positions (as many
    queries as keys: what fmha-v2 serves), ``"all"`` keeps every query (more queries
    than keys) and ``"fewer"`` drops 100 more queries from the first row.
    """
    mode = {"valid": "equal", "all": "more", "fewer": "fewer"}[queries]
    return holed_batch(seq=SEQ, kv_valid=KV_VALID, heads=HEADS, head_dim=dim, queries=mode, locality=locality)


def _reference(q, k, v, layout, lam: float | None):
    tile_kv = kv_step(q.shape[-1])
    res = reference_attention(
        layout.pack_q(q).float(),
        layout.pack_kv(k).float(),
        layout.pack_kv(v).float(),
        layout.cu_seqlens_q,
        layout.cu_seqlens_kv,
        layout.q_lens,
        layout.kv_lens,
        softmax_scale=q.shape[-1] ** -0.5,
        skip_factor=None if lam is None else lam * layout.max_seqlen_kv,
        tile_q=Q_STEP,
        tile_kv=tile_kv,
    )
    return layout.unpack_q(res.out), res.skipped_fraction


def _run(q, k, v, layout, backend: str, lam: float | None = None):
    skip = None if lam is None else SkipSoftmaxConfig(threshold=lam)
    # policy="always": on SM90 the default policy runs a bare threshold dense (policy.py, skip alone)
    out, result = run_attention(q, k, v, layout=layout, skip=skip, backend=backend, policy="always")
    assert result.route == backend
    return out.float()


def _valid(x: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    return layout.pack_q(x)  # compare valid queries only


@pytest.mark.parametrize("backend", ["fmha-v2", "fa3"])
@pytest.mark.parametrize("dim", [64, 128])
def test_dense_ragged_matches_reference(backend, dim):
    _hopper_route(backend)
    queries = "valid" if backend == "fmha-v2" else "fewer"
    q, k, v, layout = _ragged_inputs(dim=dim, queries=queries)
    ref, _ = _reference(q, k, v, layout, None)
    out = _run(q, k, v, layout, backend)
    assert rel_l1(_valid(out, layout), _valid(ref, layout)) < 1e-2
    assert cosine(_valid(out, layout), _valid(ref, layout)) > 0.9999
    if queries == "fewer":
        assert torch.all(out[0, -100:] == 0)  # dropped queries come back as zero rows


@pytest.mark.parametrize("queries, dim, kv_heads", [("fewer", 128, HEADS), ("all", 64, HEADS), ("valid", 128, HEADS // 2)])
def test_fmha_v2_refuses_what_it_gets_wrong_and_auto_moves_on(queries, dim, kv_heads):
    # Measured with FlashInfer 0.7.4 on these batches: wrong values (fewer queries than keys),
    # NaNs (more queries than keys; grouped-query heads).
    _hopper_route("fmha-v2")
    q, k, v, layout = _ragged_inputs(dim=dim, queries=queries)
    k, v = k[:, :, :kv_heads].contiguous(), v[:, :, :kv_heads].contiguous()
    call = AttentionCall(layout.pack_q(q), layout.pack_kv(k), layout.pack_kv(v), layout, dim**-0.5)
    assert get_route("fmha-v2").not_supported_reasons(call)
    ref, _ = _reference(q, k, v, layout, None)
    out, result = run_attention(q, k, v, layout=layout)
    assert result.route != "fmha-v2"
    assert rel_l1(_valid(out.float(), layout), _valid(ref, layout)) < 1e-2


def test_skip_that_skips_nothing_equals_dense():
    _hopper_route("fmha-v2")
    q, k, v, layout = _ragged_inputs()
    lam = 1e-30
    _, skipped = _reference(q, k, v, layout, lam)
    assert skipped == 0.0
    dense = _run(q, k, v, layout, "fmha-v2")
    skip = _run(q, k, v, layout, "fmha-v2", lam)
    assert rel_l1(_valid(skip, layout), _valid(dense, layout)) < 1e-3


@pytest.mark.parametrize("repeat", range(3))  # NaNs came and went between runs on unequal lengths
def test_skip_error_grows_with_the_reference(repeat):
    _hopper_route("fmha-v2")
    q, k, v, layout = _ragged_inputs(locality=0.5)
    ref_dense, _ = _reference(q, k, v, layout, None)
    ref_errors, kernel_errors, fractions = [], [], []
    for lam in (1e-3, 1e-2, 5e-2, 0.2):
        ref_skip, skipped = _reference(q, k, v, layout, lam)
        out = _run(q, k, v, layout, "fmha-v2", lam)
        fractions.append(skipped)
        ref_errors.append(rel_l1(_valid(ref_skip, layout), _valid(ref_dense, layout)))
        kernel_errors.append(rel_l1(_valid(out, layout), _valid(ref_dense, layout)))
    print("skipped", fractions, "reference rel-L1", ref_errors, "fmha-v2 rel-L1", kernel_errors)
    assert fractions == sorted(fractions) and fractions[-1] > 0.3
    assert ref_errors[-1] > ref_errors[0]
    for ref_err, ker_err in zip(ref_errors, kernel_errors):
        # bf16 rounding (~4e-3) on top of the reference's own skipping error, within a factor 2
        assert ker_err <= 2.0 * ref_err + 6e-3
        assert ker_err >= 0.5 * ref_err - 6e-3


@pytest.mark.parametrize("batch", [1, 3])
def test_fa3_lse_matches_reference(batch):
    """Ring attention's log-sum-exp from fa3 (FlashInfer's log2 LSE scaled to the natural log): one sequence
    (single prefill) and a ragged batch (the wrapper), against the reference's."""
    _hopper_route("fa3")
    q, k, v, layout = _ragged_inputs(queries="fewer")
    if batch == 1:
        q, k, v, layout = q[:1], k[:1], v[:1], PackedLayout.dense(1, q.shape[1], k.shape[1], "cuda")
    out, result = run_attention(q, k, v, layout=layout, backend="fa3", return_lse=True)
    assert result.route == "fa3" and result.lse.shape == q.shape[:3] and result.lse.dtype == torch.float32
    ref = reference_attention(layout.pack_q(q).float(), layout.pack_kv(k).float(), layout.pack_kv(v).float(),
                              layout.cu_seqlens_q, layout.cu_seqlens_kv, layout.q_lens, layout.kv_lens,
                              softmax_scale=q.shape[-1] ** -0.5)
    lse = layout.pack_q(result.lse[..., None])[..., 0]
    assert (lse - ref.lse).abs().max() < 2e-2, (lse - ref.lse).abs().max()


@pytest.mark.parametrize("backend", ["fmha-v2", "fmha-v2-fp8"])
@pytest.mark.parametrize("lam", [None, 1e-2])
def test_fmha_v2_lse_matches_reference(backend, lam):
    """Ring attention's log-sum-exp from FMHAv2's softmax stats (``CONTIGUOUS_Q_KV``) on a ragged batch of
    equal-length sequences, against the reference's with fmha-v2's tiles and the same skip rule. Decides the
    reading of the stats in ``kernels/fmha_v2.py`` (row max of ``q . k`` over ``sqrt(d)``, natural-units sum):
    in fp8 ``bmm1_scale`` is far from ``1/sqrt(d)``, so a wrong reading would miss by whole units, far beyond
    fp8's rounding of logits up to ~30 (the fp8 bounds below)."""
    from diffusers_trtllm.config import QuantConfig
    from diffusers_trtllm.kernels import fmha_v2_fp8

    fp8 = backend == "fmha-v2-fp8"
    quant = {"dtype_qk": "fp8_e4m3"} if fp8 else None
    _hopper_route(backend, quant=QuantConfig(**quant) if fp8 else None, return_lse=True)
    q, k, v, layout = _ragged_inputs()
    skip = None if lam is None else SkipSoftmaxConfig(threshold=lam)

    def lse_of(skip):
        out, result = run_attention(q, k, v, layout=layout, skip=skip, quant=quant, backend=backend,
                                    return_lse=True, policy="always")
        assert result.route == backend and result.lse.shape == q.shape[:3] and result.lse.dtype == torch.float32
        return out, layout.pack_q(result.lse[..., None])[..., 0]

    out, lse = lse_of(skip)
    ref = reference_attention(layout.pack_q(q).float(), layout.pack_kv(k).float(), layout.pack_kv(v).float(),
                              layout.cu_seqlens_q, layout.cu_seqlens_kv, layout.q_lens, layout.kv_lens,
                              softmax_scale=q.shape[-1] ** -0.5, skip_factor=None if lam is None else lam * layout.max_seqlen_kv,
                              tile_q=Q_STEP, tile_kv=(fmha_v2_fp8.kv_step if fp8 else kv_step)(q.shape[-1]))
    diff = (lse - ref.lse).abs()
    print(f"{backend} lambda={lam}: skipped {ref.skipped_fraction:.2f}, LSE |diff| max {diff.max():.4f} "
          f"median {diff.median():.5f}, output rel-L1 {rel_l1(_valid(out.float(), layout), ref.out.float()):.4f}")
    bias = (lse - ref.lse).mean()
    print(f"  mean signed difference {bias:.5f}")
    assert not lse.isnan().any()
    # fp8: per-tensor e4m3 Q and K move every logit by up to a few tenths (the first H200 run measured a
    # median |diff| of 0.055 and a max of 0.51, with the output 0.071 rel-L1 from dense), so a wrong reading
    # of the stats shows as a bias of every row, checked first; ring's use of the LSE is checked by
    # ``test_fmha_v2_kv_shards_merge_by_lse``.
    assert bias.abs() < (2e-2 if fp8 else 5e-3)
    if lam is None:
        assert diff.max() < (1.0 if fp8 else 2e-2) and diff.median() < (0.1 if fp8 else 5e-3)
    else:  # a tile at the threshold may be skipped by one and kept by the other (bf16 vs fp32 maxima)
        assert ref.skipped_fraction > 0.1
        assert diff.median() < (0.1 if fp8 else 5e-3) and diff.max() < (1.0 if fp8 else 0.2)
        _, dense = lse_of(None)
        assert (lse - dense).max() < (0.05 if fp8 else 1e-2)  # skipped keys only lower the LSE


@pytest.mark.parametrize("backend", ["fmha-v2", "fmha-v2-fp8"])
@pytest.mark.parametrize("lam", [None, 1e-2])
def test_fmha_v2_kv_shards_merge_by_lse(backend, lam):
    """What ring attention does with the log-sum-exp: one query shard against two KV shards of its length
    (FMHAv2 serves as many queries as keys), merged by the shards' log-sum-exp, is as close to dense
    attention over all the keys as each shard's output is to dense attention over its own keys."""
    import torch.nn.functional as F

    from diffusers_trtllm.bench.inputs import parse_shapes, structured_qkv
    from diffusers_trtllm.bench.ring_skip import merge_by_lse
    from diffusers_trtllm.config import QuantConfig

    quant = QuantConfig("fp8_e4m3") if backend == "fmha-v2-fp8" else None
    _hopper_route(backend, quant=quant, return_lse=True)
    (shape,) = parse_shapes("ring=1:4096:4:128")
    q, k, v = structured_qkv(shape, 0.5, device="cuda")
    half = q.shape[1] // 2
    q = q[:, :half]

    def dense(keys, values):
        return F.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, keys, values))).transpose(1, 2)

    shards, own_errors = [], []
    for part in (slice(0, half), slice(half, None)):
        out, result = run_attention(q, k[:, part], v[:, part], skip=lam, quant=quant, backend=backend,
                                    return_lse=True, policy="always")
        assert result.route == backend
        shards.append((out.float(), result.lse))
        own_errors.append(rel_l1(out.float(), dense(k[:, part], v[:, part])))
    merged, _ = merge_by_lse(shards)  # Diffusers' ring formula
    error = rel_l1(merged, dense(k, v))
    print(f"{backend} lambda={lam}: merged rel-L1 {error:.4f}, shards' own {own_errors}")
    assert error <= max(own_errors) + 5e-3
