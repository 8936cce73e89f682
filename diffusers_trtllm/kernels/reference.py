"""PyTorch oracle for every route: exact dense attention, the skip-softmax tile
rule and SAGE quantization (as quantize-then-dequantize), on any device.

Memory stays bounded: one sequence at a time, query tiles in chunks, KV tile by
KV tile with an online softmax, so a 32k-token, 12-head sequence fits on a CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import DEFAULT_K_BLOCK, QuantConfig
from ..routing.registry import AttentionCall, AttentionResult, Capabilities, Route, register_route

__all__ = ["ReferenceResult", "ReferenceRoute", "reference_attention", "sage_quantize", "SageTensors", "P_FP8_SCALE",
           "channel_mean", "scale_slots"]

#: Floor of a block's amax before it becomes a scale (docs/design.md, SAGE quantization).
AMAX_FLOOR = 1.0e-3
FP8_MAX = 448.0
#: The largest finite fp16: SAGE outputs with V's mean taken off are clamped to it (NaN kept) before an fp16 store.
FP16_MAX = torch.finfo(torch.float16).max  # 65504
#: P (in [0, 1]) is multiplied by this before its fp8 cast for the P·V product.
P_FP8_SCALE = 448.0
#: Elements of the score tile processed at once (bounds memory at ~256 MiB fp32).
_CHUNK_ELEMENTS = 64 * 1024 * 1024


@dataclass
class SageTensors:
    """Quantized Q/K/V with their scales, in FlashInfer's SAGE layout.

    ``q_scale``: ``[heads, n_q_slots]``, ``k_scale``: ``[kv_heads, n_k_slots]``
    (slots as ``block_ids`` numbers them: blocks never straddle two sequences);
    ``v_scale``: ``[kv_heads, dim]``. ``k`` is smoothed when ``smooth_k`` was set; with ``v_mean``
    (``[kv_heads, dim]``, ``smooth_v``) ``v`` holds V less that mean, which the output gets back; ``k_mean``
    (``[kv_heads, dim]``) is what ``smooth_k`` took off K, which the log-sum-exp gets back.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    q_block_id: torch.Tensor
    k_block_id: torch.Tensor
    v_mean: torch.Tensor | None = None
    k_mean: torch.Tensor | None = None

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Back to float32 ``[tokens, heads, dim]`` (V without its mean when ``smooth_v``: see ``v_mean``)."""
        q = self.q.float() * self.q_scale.t()[self.q_block_id][:, :, None]
        k = self.k.float() * self.k_scale.t()[self.k_block_id][:, :, None]
        v = self.v.float() * self.v_scale[None]
        return q, k, v


def per_q_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """A ``[kv_heads, dim]`` statistic repeated for the query heads each KV head serves."""
    return x.repeat_interleave(heads // x.shape[0], dim=0)


def lse_before_smoothing(lse: torch.Tensor, q: torch.Tensor, k_mean: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """The ``[tokens, heads]`` log-sum-exp of the logits before ``smooth_k``: taking K's mean off lowered every
    logit of a row by ``softmax_scale * q . k_mean``, ``q`` the queries the logits were made of (under SAGE the
    dequantized ones, so that each KV shard's correction matches its own logits). Softmax does not see it, but
    ring attention merges KV shards (each with its own mean) by the log-sum-exp, so every route hands back the
    unsmoothed one."""
    k_mean = per_q_head(k_mean, q.shape[1])
    return lse + softmax_scale * torch.cat([torch.einsum("thd,hd->th", x.float(), k_mean) for x in q.split(8192)])


def channel_mean(x: torch.Tensor) -> torch.Tensor:
    """``[heads, dim]`` float32 mean over every packed token: the vector ``smooth_v`` takes off (the kernels'
    quantizer sums it in one pass with V's extremes, ``triton_quant.kv_stats``, equal to this up to fp32 rounding)."""
    return x.mean(dim=0, dtype=torch.float32)


#: Keys ``key_mean`` averages, about (every ``len(k) // KEY_MEAN_SAMPLE``-th: 1,024 to 2,047 of longer K):
#: softmax is unchanged by any vector taken off K, so an even sample of the keys serves as well as all of them and
#: spares most of a pass over K (at Wan 480p, 32,760 keys, most of what smoothing cost:
#: benchmarks/results/sage_sm90_sweep_h200_smooth_480p.md). 1,024 where it was 4,096: the quantizer 10% faster at
#: Flux 1024² on an H100 (100 -> 90 us), rel-L1 the same to 1e-4 (benchmarks/results/key_mean_sample_h100.md).
KEY_MEAN_SAMPLE = 1024


def key_mean(k: torch.Tensor) -> torch.Tensor:
    """What ``smooth_k`` takes off K: :func:`channel_mean` of every ``len(k) // KEY_MEAN_SAMPLE``-th key, with 0 in
    a channel whose mean is not finite. The mean spans every sequence of the batch; an inf or NaN key would
    otherwise spread through it to every key of that channel, the other sequences' too, where dense attention
    keeps it to the rows that attend to it."""
    step = max(1, k.shape[0] // KEY_MEAN_SAMPLE)
    return torch.nan_to_num(channel_mean(k[::step]), nan=0.0, posinf=0.0, neginf=0.0)


def scale_slots(lens: tuple[int, ...], block: int, per_thread: bool = False) -> int:
    """Scale slots of FlashInfer's layout, ``ceil(total / block) + num_seqs - 1``; four per block split per thread."""
    return (-(-sum(lens) // block) + len(lens) - 1) * (4 if per_thread else 1)


def block_ids(cu_seqlens: torch.Tensor, lens: tuple[int, ...], block: int,
              per_thread: bool = False) -> tuple[torch.Tensor, int]:
    """Scale slot of each packed token, and the number of slots, in FlashInfer's layout.

    Token ``t`` of sequence ``b`` uses slot ``cu_seqlens[b] // block + b + t // block``
    out of ``ceil(total / block) + batch - 1``: the ``+ b`` keeps a trailing partial
    block from being shared with the next sequence (some slots stay unused). ``per_thread`` splits every
    block's slot in four (``QuantConfig.k_per_thread``): slot ``4 * s + (t % 8) // 2``.
    """
    device = cu_seqlens.device
    ids, start = [], 0
    for b, n in enumerate(lens):
        t = torch.arange(n, device=device)
        slot = t // block + (start // block + b)
        ids.append(4 * slot + (t % 8) // 2 if per_thread else slot)
        start += n
    return (torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long, device=device)), scale_slots(lens, block, per_thread)


def _scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """``max(amax, floor) / qmax`` as an IEEE quotient, as the kernels compute it: on CUDA torch divides by a Python
    scalar as a multiply by its reciprocal, which lands one ulp off on about half the values."""
    amax = amax.float().clamp_min(AMAX_FLOOR)
    return amax / torch.full_like(amax, qmax)


def _reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` rounded to nearest (a tensor quotient: IEEE on CUDA too). Values are quantized as
    ``x * (1 / scale)``, the product rounded on its own, as the quantizer kernels do it (one multiply a value)."""
    return torch.ones_like(scale) / scale


def _quantize_blocks(x: torch.Tensor, ids: torch.Tensor, n_blocks: int, qmax: float, dtype: torch.dtype):
    """Per-(head, block) scale ``max(amax, floor) / qmax``; values ``x * (1 / scale)`` rounded and saturated."""
    tokens, heads, _ = x.shape
    amax = x.abs().amax(dim=-1).float()  # [tokens, heads]
    block_amax = torch.zeros(n_blocks, heads, device=x.device, dtype=torch.float32)
    block_amax.scatter_reduce_(0, ids[:, None].expand(-1, heads), amax, "amax")
    scale = _scale(block_amax, qmax)  # [blocks, heads]
    scaled = x.float() * _reciprocal(scale)[ids][:, :, None]
    if dtype == torch.int8:
        quant = scaled.round().clamp(-qmax, qmax).to(torch.int8)
    else:
        quant = scaled.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return quant, scale.t().contiguous()


def sage_quantize(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    q_lens: tuple[int, ...],
    kv_lens: tuple[int, ...],
    quant: QuantConfig,
    smooth_v: bool = False,
    v_mean: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
) -> SageTensors:
    """SAGE quantization of packed ``[tokens, heads, dim]`` Q, K, V (docs/design.md, SAGE quantization).

    ``smooth_v``: V less its per-(head, channel) mean before fp8, as the project's Hopper kernels quantize
    it (docs/design.md, "V's mean"); FlashInfer's quantizer does not. ``v_mean``: that mean as a kernel's
    quantizer summed it (``triton_quant.kv_stats``, another order than :func:`channel_mean`'s), to compare the rest
    bit for bit; ``k_mean`` likewise K's mean with ``quant.smooth_k`` (None: :func:`key_mean`).
    """
    quant = quant.with_k_block(DEFAULT_K_BLOCK)
    if smooth_v and v_mean is None:
        v_mean = channel_mean(v)
    elif not smooth_v and v_mean is not None:
        raise ValueError("v_mean is V's mean taken off with smooth_v=True; pass smooth_v=True with it.")
    if quant.smooth_k and k_mean is None:
        k_mean = key_mean(k)
    elif not quant.smooth_k and k_mean is not None:
        raise ValueError("k_mean is K's mean taken off with quant.smooth_k=True; pass a quant with smooth_k=True.")
    k = k.float() if k_mean is None else k.float() - k_mean
    q_ids, nq = block_ids(cu_seqlens_q, q_lens, quant.q_block_size)
    k_ids, nk = block_ids(cu_seqlens_kv, kv_lens, quant.k_block_size, quant.k_per_thread)
    q_q, q_scale = _quantize_blocks(q, q_ids, nq, quant.qk_max, quant.qk_dtype)
    k_q, k_scale = _quantize_blocks(k, k_ids, nk, quant.qk_max, quant.qk_dtype)
    v = v.float() if v_mean is None else v.float() - v_mean
    v_scale = _scale(v.abs().amax(dim=0), FP8_MAX)  # [heads, dim]
    v_q = (v * _reciprocal(v_scale)[None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return SageTensors(q_q, k_q, v_q, q_scale, k_scale, v_scale, q_ids, k_ids, v_mean, k_mean)


@dataclass
class ReferenceResult:
    out: torch.Tensor
    skipped_tiles: int
    total_tiles: int
    #: ``[q_tokens, heads]`` float32: natural log of each row's softmax denominator over the keys
    #: it attended (skipped tiles excluded), scaled-logit domain; what ring attention merges by.
    lse: torch.Tensor | None = None

    @property
    def skipped_fraction(self) -> float:
        return self.skipped_tiles / self.total_tiles if self.total_tiles else 0.0


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    q_lens: tuple[int, ...],
    kv_lens: tuple[int, ...],
    *,
    softmax_scale: float,
    skip_factor: float | None = None,
    quant: QuantConfig | None = None,
    tile_q: int = 128,
    tile_kv: int = 128,
    heads: slice | None = None,
    sage: SageTensors | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    smooth_v: bool = False,
) -> ReferenceResult:
    """Attention over packed ``[tokens, heads, dim]`` tensors, non-causal.

    ``skip_factor`` enables the skip rule with ``lambda = skip_factor / kv_len``
    per sequence: KV tile ``j > 0`` of a query tile is skipped when every row has
    ``exp(local_max - running_max) < lambda``. With ``quant`` Q/K/V go through
    SAGE quantization and P is rounded to fp8 before P·V, as the kernels do.
    ``heads`` restricts the work to some heads (the benchmark subsamples them).
    ``sage`` takes already quantized tensors instead (``q``/``k``/``v`` are then
    those quantized tensors and the output has ``out_dtype``), to check a kernel's
    quantizer and attention separately. ``smooth_v`` quantizes V as the project's Hopper kernels do
    (``sage_quantize``).
    """
    out_dtype = q.dtype if sage is None else out_dtype
    if sage is None and quant is not None and quant.enabled:
        sage = sage_quantize(q, k, v, cu_seqlens_q, cu_seqlens_kv, q_lens, kv_lens, quant, smooth_v)
    pv_fp8 = sage is not None
    q, k, v = sage.dequantize() if pv_fp8 else (q.float(), k.float(), v.float())
    group = q.shape[1] // k.shape[1]
    if group > 1:  # grouped-query attention: give every query head its own K/V view
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if heads is not None:
        q, k, v = q[:, heads], k[:, heads], v[:, heads]
    # Softmax rows sum to 1, so the mean V lost to smooth_v comes back whole on every row that has keys.
    smoothed_v = sage is not None and sage.v_mean is not None
    v_mean = 0.0
    if smoothed_v:
        v_mean = sage.v_mean.repeat_interleave(group, dim=0)
        v_mean = v_mean if heads is None else v_mean[heads]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    skipped = total = 0
    q0 = kv0 = 0
    for lq, lkv in zip(q_lens, kv_lens):
        if lq and lkv:
            qs = q[q0 : q0 + lq].transpose(0, 1)  # [H, lq, D]
            ks = k[kv0 : kv0 + lkv].transpose(0, 1)
            vs = v[kv0 : kv0 + lkv].transpose(0, 1)
            lam = None if skip_factor is None else skip_factor / lkv
            o, row_lse, s, t = _attend_sequence(qs, ks, vs, softmax_scale, lam, pv_fp8, tile_q, tile_kv)
            out[q0 : q0 + lq] = o.transpose(0, 1) + v_mean
            lse[q0 : q0 + lq] = row_lse.transpose(0, 1)
            skipped, total = skipped + s, total + t
        q0, kv0 = q0 + lq, kv0 + lkv
    if sage is not None and sage.k_mean is not None:
        k_mean = per_q_head(sage.k_mean, group * sage.k_mean.shape[0])
        lse = lse_before_smoothing(lse, q, k_mean if heads is None else k_mean[heads], softmax_scale)
    if smoothed_v and out_dtype == torch.float16:  # as the kernels store it: fp8's rounding of V less its
        out = out.clamp(-FP16_MAX, FP16_MAX)  # mean can take an average at fp16's limit past it (NaN stays NaN)
    return ReferenceResult(out.to(out_dtype), skipped, total, lse)


def _attend_sequence(q, k, v, scale, lam, pv_fp8, tile_q, tile_kv):
    """One sequence, ``[H, L, D]`` float32: online softmax over KV tiles, query tiles in chunks.

    Returns the output, each row's log-sum-exp ``[H, Lq]``, and the skipped and total tile counts.
    """
    heads, lq, _ = q.shape
    lkv = k.shape[1]
    n_qt, n_kt = -(-lq // tile_q), -(-lkv // tile_kv)
    tiles_per_chunk = max(1, _CHUNK_ELEMENTS // (heads * tile_q * tile_kv))
    out = torch.empty(heads, lq, v.shape[-1], device=q.device)
    lse = torch.empty(heads, lq, device=q.device)
    skipped = 0
    for t0 in range(0, n_qt, tiles_per_chunk):
        r0, r1 = t0 * tile_q, min(lq, (t0 + tiles_per_chunk) * tile_q)
        qc = q[:, r0:r1]
        rows = r1 - r0
        n_tiles = -(-rows // tile_q)
        pad_rows = n_tiles * tile_q - rows
        m = torch.full((heads, rows), -math.inf, device=q.device)
        denom = torch.zeros(heads, rows, device=q.device)
        acc = torch.zeros(heads, rows, v.shape[-1], device=q.device)
        for j in range(n_kt):
            c0, c1 = j * tile_kv, min(lkv, (j + 1) * tile_kv)
            s = torch.matmul(qc, k[:, c0:c1].transpose(1, 2)) * scale  # [H, rows, cols]
            local = s.amax(dim=-1)
            if lam is not None and j > 0:
                below = torch.exp(local - m) < lam
                below = torch.nn.functional.pad(below, (0, pad_rows), value=True)
                tile_skip = below.view(heads, n_tiles, tile_q).all(dim=-1)  # [H, n_tiles]
                skipped += int(tile_skip.sum())
                row_skip = tile_skip.repeat_interleave(tile_q, dim=1)[:, :rows]
                m_new = torch.where(row_skip, m, torch.maximum(m, local))
            else:
                row_skip = None
                m_new = torch.maximum(m, local)
            p = torch.exp(s - m_new[..., None])
            if row_skip is not None:
                p = p.masked_fill(row_skip[..., None], 0.0)
            alpha = torch.exp(m - m_new)
            denom = denom * alpha + p.sum(dim=-1)
            if pv_fp8:
                p = (p * P_FP8_SCALE).to(torch.float8_e4m3fn).float() / P_FP8_SCALE
            acc = acc * alpha[..., None] + torch.matmul(p, v[:, c0:c1])
            m = m_new
        out[:, r0:r1] = acc / denom[..., None]
        lse[:, r0:r1] = m + torch.log(denom)
    return out, lse, skipped, heads * n_qt * n_kt


class ReferenceRoute(Route):
    """The oracle as a route: exact skip rule and emulated SAGE, on any device; never auto."""

    name = "reference"
    auto = False
    caps = Capabilities(
        device_types=frozenset({"cuda", "cpu"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        skip_softmax=True,
        sage_dtypes=frozenset({"int8", "fp8_e4m3"}),
        k_per_thread=True,
        lse=True,
    )

    def run(self, call: AttentionCall) -> AttentionResult:
        layout = call.layout
        res = reference_attention(
            call.q,
            call.k,
            call.v,
            layout.cu_seqlens_q,
            layout.cu_seqlens_kv,
            layout.q_lens,
            layout.kv_lens,
            softmax_scale=call.softmax_scale,
            skip_factor=call.skip_factor,
            quant=call.quant,
        )
        return AttentionResult(res.out, self.name, res.skipped_tiles, res.total_tiles,
                               lse=res.lse if call.return_lse else None)


register_route(ReferenceRoute())
