"""SAGE quantization for the ``triton`` route: Q's tiles beside K and V's statistics, then K's and V's tiles.

Produces docs/design.md's layout (the one ``reference.sage_quantize`` defines): Q/K int8
or fp8 e4m3 with one scale per (head, block of consecutive tokens of one
sequence), V fp8 e4m3 with one scale per (head, channel), V less its per-(head, channel) mean
(``smooth_v``), which the attention kernels add back to their output. Two launches (three for long calls):

1. ``_q_and_stats_kernel``: first the statistics, a program per (kv head, span of ``V_STATS_ROWS`` tokens), the
   long programs so that they start first: one pass over V for its sum, min and max per channel and over K's
   sample for its sum (``smooth_k``); then Q's tiles, which need no statistic over the tokens. Each span stores
   its partials and takes a ticket from its head's counter; the span that draws the last one folds the head's
   spans in span order (the same bits every run, whichever span finishes last) into the means and V's channel
   scales, and resets the counter for the next call. No program waits for another.
2. ``_kv_quant_kernel``: K's and V's tiles, reading those stats. Calls of more than ``QUANT_ONE_LAUNCH_TOKENS``
   keys launch K and V apart (``quant_launches``), each compiled with only its own part, so that V's small tiles
   do not pay the registers of K's larger ones; shorter calls launch both at once, where a launch's fixed cost
   (host time too) weighs more.

Each tile of consecutive tokens (64, K tiles a K block when that is longer) of one (head, sequence) is read
once, coalesced. V's channel scales need its amax less the mean over every token before any V tile can be
quantized; the min and max give it exactly (``_kv_stats_fold``), so no reduction over the tokens runs with the
tiles. (Two earlier layouts measured slower on the H200, docs/design.md, "The quantizer": V by channel programs
that read all tokens twice, a long serial path per program; and V by token tiles folding their amax into the
scales by an atomic max, then a second launch.)

V is written transposed, ``[kv_heads * dim, padded tokens]``, because Hopper's
fp8 tensor-core product needs the reduction dimension (tokens, in P·V)
contiguous. Sequence ``b`` starts there at column ``vt_start(b) = 16 * (cu[b] // 16
+ 2 * b)``, a multiple of 16 (TMA box offsets along the contiguous dimension must
be 16-byte aligned) computable in-kernel; the gap up to the next start is zeroed.
With ``mma_key_order`` (the ``sage-sm90`` kernel's layout) the keys of every aligned group of 16
columns are stored permuted, position ``4t + 2h + e`` holding key ``8h + 2t + e``: the order in which that
kernel's P·V product reads P straight from its score registers (``csrc/sage_sm90.cu``).
int8 values are rounded explicitly (round half to even, ``_rne``) and fp8 ones by the native cast, which
rounds half to even too, so the stored values equal the reference's. Where fp8 is not native (the Triton
interpreter, whose fp8 casts round wrongly, and SM80/86, which have no fp8), values are rounded to the e4m3
grid in fp32 first and V is kept in fp16: the arithmetic is the same.

Triton is imported at module import; ``triton_attn`` imports this module lazily.
"""

from __future__ import annotations

import functools
import itertools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..config import DEFAULT_K_BLOCK, QuantConfig
from ..layout import PackedLayout, _bounded_put
from . import cuda_jit
from .reference import AMAX_FLOOR, FP8_MAX, KEY_MEAN_SAMPLE, block_ids, scale_slots
from .triton_launch import BoundLaunch, cdiv, launch

__all__ = ["TritonSage", "sage_quantize_triton", "mma_key_column", "fp8_native", "interpreting", "round_fp8_grid", "vt_start", "max_nan", "kv_stats",
           "KVStats", "quant_launches"]

#: Tokens per Q or V program of the quantization kernel: a multiple of every Q block size (K programs take
#: max(this, the K block): a tile starts whole blocks) and of 16 (V's key order permutes within groups of 16).
QUANT_BLOCK_T = 128
#: The most columns ``vt_start`` leaves between a sequence's last key and the next sequence's first (17 the least).
VT_GAP_MAX = 47
#: Warps per program of QUANT_BLOCK_T tokens. A launch with K tiles of more tokens gives all its programs
#: proportionally more, so that a K tile's threads hold no more values each than a Q tile's. 128 tokens of 4 warps
#: (128 values a thread, ~170-180 registers, two programs an SM, each thread's loads all in flight at once) ran
#: the quantizer in 62 us at flux_1024 against 78 for 64 of 8, 199 against 219 at 16,896 keys (H200, GPU-bound,
#: benchmarks/results/quantizer_sweep_h200_gpu_bound.md).
QUANT_WARPS = 4
#: The launches after the first (which quantizes Q beside K and V's statistics), each the parts (K, V) it
#: quantizes: a part launched alone is compiled alone, with the registers its own tiles need. Calls of at most
#: ``QUANT_ONE_LAUNCH_TOKENS`` keys make one launch of both (``QUANT_SHORT_LAUNCHES``), where a launch's fixed
#: cost weighs more than the registers.
QUANT_LAUNCHES = ("k", "v")
QUANT_SHORT_LAUNCHES = ("kv",)
QUANT_ONE_LAUNCH_TOKENS = 16896
#: Tokens per statistics program of the first launch (at Wan 480p, 64 spans of each of the 40 heads), the tokens
#: it reads per step (with ``QUANT_WARPS`` warps, the first launch's; set when those were 8 a program of 64 tokens,
#: where 32 took more registers than Q's tiles), and the steps its loads are issued ahead (``tl.range`` stages): a
#: long serial chain of loads in the program that starts first would otherwise bound the launch.
V_STATS_ROWS = 512
V_STATS_BLOCK_T = 16
V_STATS_STAGES = 3
#: (Spans of fewer tokens on short V, at least 2,048 programs, and a fold 16 spans a step, measured slower on an
#: H100 when the stats had launches of their own: 57 + 28 us against 40 + 3 us at flux_1024, 100 + 29 us against
#: 81 + 10 us at 16,896 tokens; benchmarks/results/profile_call_h100_run2.md against _run1.md.)
_AMAX_FLOOR, _FP8_MAX = tl.constexpr(AMAX_FLOOR), tl.constexpr(FP8_MAX)
#: Launch options of the launches that quantize: no fused multiply-add, so that ``x * (1 / scale)`` is rounded before
#: the rounding to the int8 grid adds to it, as ``reference``'s is (fused, it rounds once and can differ at a tie).
_UNFUSED = dict(enable_fp_fusion=False)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def fp8_native(device: torch.device) -> bool:
    """fp8 e4m3 casts and tensor-core products exist (SM89+), and we are not interpreting."""
    if interpreting() or device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@dataclass
class TritonSage:
    """Quantized Q/K/V and scales as the attention kernel reads them.

    ``q``/``k``: ``[tokens, heads, dim]`` int8 or fp8; ``vt``: ``[kv_heads * dim, tokens_padded]``
    fp8 (fp16 holding e4m3 values where fp8 is not native), sequence ``b`` from column
    ``vt_start(b)``; scales as in ``SageTensors``
    (token ``t`` of sequence ``b`` uses scale slot ``cu_seqlens[b] // block + b + t // block``;
    unused slots are left unwritten).
    """

    q: torch.Tensor
    k: torch.Tensor
    vt: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    #: ``[kv_heads, dim]`` float32: V's mean over every token, taken off before fp8 (``vt`` holds V less it)
    #: and added back to the output by the attention kernels.
    v_mean: torch.Tensor
    #: ``vt``'s keys are in the ``sage-sm90`` kernel's order within each group of 16 columns.
    mma_key_order: bool = False
    #: ``[kv_heads, dim]`` float32: K's mean, taken off before quantizing (``smooth_k``; None without it).
    k_mean: torch.Tensor | None = None

    def dequantized_q(self, layout: PackedLayout, q_block_size: int) -> torch.Tensor:
        """Q as the kernels' logits see it, ``[tokens, heads, dim]`` float32: the quantized values times their
        scales (the queries ``lse_before_smoothing`` takes)."""
        ids, _ = block_ids(layout.cu_seqlens_q, layout.q_lens, q_block_size)
        return self.q.float() * self.q_scale.t()[ids][:, :, None]

    def v(self, layout: PackedLayout) -> torch.Tensor:
        """V back in ``[tokens, kv_heads, dim]`` order (for tests and inspection)."""
        kv_heads, dim = self.v_scale.shape
        cu = [0, *itertools.accumulate(layout.kv_lens)]
        cols = torch.cat([torch.arange(n) + vt_start.fn(b, cu[b]) for b, n in enumerate(layout.kv_lens)])
        if self.mma_key_order:
            cols = mma_key_column.fn(cols)
        return self.vt[:, cols.to(self.vt.device)].reshape(kv_heads, dim, -1).permute(2, 0, 1)


@triton.jit
def vt_start(seq, kv_start):
    """Column of sequence ``seq``'s first token in the transposed V (``vt_start.fn`` on the host)."""
    return 16 * (kv_start // 16 + 2 * seq)


@triton.jit
def mma_key_column(col):
    """Where key column ``col`` of the transposed V is stored in the ``sage-sm90`` order (``mma_key_column.fn``
    on the host): within its aligned group of 16, key ``8h + 2t + e`` moves to ``4t + 2h + e``."""
    c = col % 16
    return col - c + 4 * ((c % 8) // 2) + 2 * (c // 8) + c % 2


@triton.jit
def mma_column_key(col):
    """The key stored at column ``col`` in the ``sage-sm90`` order (``mma_key_column``'s inverse): within its
    aligned group of 16, column ``4t + 2h + e`` holds key ``8h + 2t + e``."""
    c = col % 16
    return col - c + 8 * ((c // 2) % 2) + 2 * (c // 4) + c % 2


@triton.jit
def _maximum_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def max_nan(x, axis):
    """``tl.max`` that returns NaN where a NaN is reduced (``tl.max`` skips NaNs, ``torch.amax`` does not)."""
    return tl.reduce(x, axis, _maximum_nan)


@triton.jit
def _rne(x):
    """Round to the nearest integer, ties to even (|x| <= 2**22), as ``torch.round``: adding 1.5 * 2**23 leaves no
    fraction bits, so the fp32 add rounds to nearest even, and taking it off again is exact. Two adds, where
    floor-based rounding took nine instructions per value (docs/design.md, "The quantizer")."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def round_fp8_grid(x):
    """Round fp32 values (|x| <= 448) to the nearest e4m3 value, ties to even, staying fp32."""
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -0x100000).to(tl.float32, bitcast=True)  # keep 3 mantissa bits
    subnormal = _rne(x * 512.0) * 0.001953125  # multiples of 2**-9
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _amax_scale(amax, qmax):
    """The scale of values whose amax is ``amax``, on a grid of magnitude ``qmax`` (NaN stays NaN)."""
    return tl.math.div_rn(tl.maximum(amax, _AMAX_FLOOR, propagate_nan=tl.PropagateNan.ALL), qmax)


@triton.jit
def _reciprocal(scale):
    """``1 / scale`` rounded to nearest: values are quantized as ``x * (1 / scale)``, one multiply each where a
    correctly rounded division took a reciprocal, its check and a fix-up (the quantizers' launches turn off
    multiply-add fusion, so the product is rounded before the rounding to the grid, as ``reference``'s)."""
    return tl.math.div_rn(1.0, scale)


@triton.jit
def _quantize_tile(x, QMAX: tl.constexpr, BS: tl.constexpr, BLOCK_T: tl.constexpr, IS_INT8: tl.constexpr,
                   NATIVE: tl.constexpr, PER_THREAD: tl.constexpr):
    """Per-block scales of a ``[BLOCK_T, D]`` fp32 tile whose first row starts a block: ``[BLOCK_T // BS]``, or
    with ``PER_THREAD`` ``[BLOCK_T // BS, 4]`` (row ``r`` of a block in lane ``(r % 8) // 2``).

    A NaN or inf in a block makes its scale NaN or inf, so the attention output
    turns non-finite as torch's does, instead of the value quantizing to a finite code.
    """
    amax = max_nan(tl.abs(x), 1)
    if PER_THREAD:  # rows 8i + 2l + e of a block are lane l's
        scale = _amax_scale(max_nan(max_nan(tl.reshape(amax, (BLOCK_T // BS, BS // 8, 4, 2)), 3), 1), QMAX)
        row_inv = tl.reshape(tl.broadcast_to(_reciprocal(scale)[:, None, :, None], (BLOCK_T // BS, BS // 8, 4, 2)),
                             (BLOCK_T,))
    else:
        scale = _amax_scale(max_nan(tl.reshape(amax, (BLOCK_T // BS, BS)), 1), QMAX)
        row_inv = tl.reshape(tl.broadcast_to(_reciprocal(scale)[:, None], (BLOCK_T // BS, BS)), (BLOCK_T,))
    y = x * row_inv[:, None]
    if IS_INT8:
        y = tl.clamp(_rne(y), -QMAX, QMAX).to(tl.int8)
    else:
        y = _on_fp8_grid(tl.clamp(y, -448.0, 448.0), NATIVE).to(tl.float8e4nv)
    return y, scale


@triton.jit
def _on_fp8_grid(y, NATIVE: tl.constexpr):
    """``y`` (|y| <= 448) ready for a cast to e4m3. A native cast (``cvt.rn.satfinite``) rounds to nearest even
    itself; the interpreter's rounds wrongly, so there the values are put on the grid first, and the cast has
    nothing left to round."""
    return y if NATIVE else round_fp8_grid(y)


@triton.jit
def _q_and_stats_kernel(
    q_ptr, k_ptr, v_ptr, qo_ptr, q_scale_ptr, stats_ptr, tickets_ptr, cu_q_ptr,
    n_q_blocks, n_q_tiles, num_seqs, kv_tokens, span_rows, spans, k_step,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, Q_BS: tl.constexpr,
    QMAX: tl.constexpr, IS_INT8: tl.constexpr, NATIVE: tl.constexpr, SMOOTH_K: tl.constexpr,
    STATS_BLOCK_T: tl.constexpr, STATS_STAGES: tl.constexpr, DO_Q: tl.constexpr,
):
    # 1D grid: first K and V's statistics, a program per (head, span of span_rows tokens) (span fastest), the
    # longest programs so that they start first; then per (head, sequence) Q's tiles (tile fastest). Q needs no
    # statistic, so its tiles need not wait for them. Without DO_Q (``kv_stats``) there are no Q tiles.
    pid = tl.program_id(0)
    n_stats = spans * HKV
    if pid < n_stats:
        _kv_stats_span(k_ptr, stride_kt, stride_kh, v_ptr, stride_vt, stride_vh, stats_ptr, tickets_ptr, pid % spans,
                       pid // spans, kv_tokens, span_rows, spans, k_step, HKV, D, STATS_BLOCK_T, STATS_STAGES, SMOOTH_K)
    elif DO_Q:
        pid -= n_stats
        tile = pid % n_q_tiles
        seq = (pid // n_q_tiles) % num_seqs
        head = pid // (n_q_tiles * num_seqs)
        _quantize_rows(q_ptr, stride_qt, stride_qh, qo_ptr, H, q_scale_ptr, n_q_blocks, stats_ptr, cu_q_ptr, seq, head,
                       tile * BLOCK_T, D, BLOCK_T, Q_BS, QMAX, IS_INT8, NATIVE, False, False)


@triton.jit
def _kv_quant_kernel(
    k_ptr, v_ptr, ko_ptr, vt_ptr, k_scale_ptr, stats_ptr, cu_kv_ptr,
    n_k_blocks, n_k_tiles, n_v_tiles, vt_stride, num_seqs, stride_kt, stride_kh, stride_vt, stride_vh,
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, K_BS: tl.constexpr,
    QMAX: tl.constexpr, IS_INT8: tl.constexpr, SMOOTH_K: tl.constexpr, NATIVE: tl.constexpr,
    MMA_KEY_ORDER: tl.constexpr, K_PER_THREAD: tl.constexpr, DO_K: tl.constexpr, DO_V: tl.constexpr,
):
    # 1D grid: per (head, sequence), its K tiles, then its V tiles (tile fastest); a part this launch leaves out
    # (DO_K, DO_V false) has no tiles and no code in it. The means and V's scales are the first launch's stats.
    pid = tl.program_id(0)
    tiles = n_k_tiles + n_v_tiles
    tile = pid % tiles
    seq = (pid // tiles) % num_seqs
    head = pid // (tiles * num_seqs)
    if tile < n_k_tiles:
        if DO_K:
            _quantize_rows(k_ptr, stride_kt, stride_kh, ko_ptr, HKV, k_scale_ptr, n_k_blocks, stats_ptr, cu_kv_ptr,
                           seq, head, tile * BLOCK_K, D, BLOCK_K, K_BS, QMAX, IS_INT8, NATIVE, SMOOTH_K, K_PER_THREAD)
    elif DO_V:
        _quantize_v_rows(v_ptr, stride_vt, stride_vh, vt_ptr, vt_stride, stats_ptr + 4 * HKV * D,
                         stats_ptr + HKV * D, cu_kv_ptr, seq, head, (tile - n_k_tiles) * BLOCK_T, D, BLOCK_T, NATIVE,
                         MMA_KEY_ORDER)


@triton.jit
def _quantize_rows(x_ptr, stride_t, stride_h, out_ptr, OUT_HEADS: tl.constexpr, scale_ptr, n_blocks, mean_ptr, cu_ptr, seq,
                   head, local, D: tl.constexpr, BLOCK_T: tl.constexpr, BS: tl.constexpr, QMAX: tl.constexpr,
                   IS_INT8: tl.constexpr, NATIVE: tl.constexpr, SMOOTH: tl.constexpr, PER_THREAD: tl.constexpr):
    """Tokens ``local .. local + BLOCK_T - 1`` of one head of sequence ``seq`` of Q or K (K less its mean
    ``mean_ptr`` with ``SMOOTH``), quantized, and their block scales in slots ``cu[seq] // BS + seq + ...``
    (``PER_THREAD``: each block's four in slots ``4 * that + lane``, ``reference.block_ids``)."""
    start = tl.load(cu_ptr + seq)
    length = tl.load(cu_ptr + seq + 1) - start
    if local < length:
        dims = tl.arange(0, D)
        rows = tl.arange(0, BLOCK_T)
        ok = (local + rows) < length
        tok = (start + local + rows).to(tl.int64)
        x = tl.load(x_ptr + tok[:, None] * stride_t + head * stride_h + dims[None, :], mask=ok[:, None], other=0.0)
        x = x.to(tl.float32)
        if SMOOTH:
            x = tl.where(ok[:, None], x - tl.load(mean_ptr + head * D + dims)[None, :], 0.0)
        y, scale = _quantize_tile(x, QMAX, BS, BLOCK_T, IS_INT8, NATIVE, PER_THREAD)
        tl.store(out_ptr + tok[:, None] * (OUT_HEADS * D) + head * D + dims[None, :], y, mask=ok[:, None])
        blk = tl.arange(0, BLOCK_T // BS)
        first = start // BS + seq + local // BS
        if PER_THREAD:
            slots = 4 * (first + blk)[:, None] + tl.arange(0, 4)[None, :]
            tl.store(scale_ptr + head * n_blocks + slots, scale, mask=((local + blk * BS) < length)[:, None])
        else:
            tl.store(scale_ptr + head * n_blocks + first + blk, scale, mask=(local + blk * BS) < length)


@triton.jit
def _quantize_v_rows(v_ptr, stride_t, stride_h, vt_ptr, vt_stride, v_scale_ptr, v_mean_ptr, cu_ptr, seq, head, local,
                     D: tl.constexpr, BLOCK_T: tl.constexpr, NATIVE: tl.constexpr, MMA_KEY_ORDER: tl.constexpr):
    """Columns ``local .. local + BLOCK_T - 1`` of one head of sequence ``seq`` in the transposed V: V less its mean
    in fp8 where the column holds a key, zeros in the gap up to the next sequence's start (the grid's V tiles
    cover that whole span, so a neighbour's masked last KV tile reads zeros there).

    The tile gathers the keys in column order and stores whole rows of columns, so the stores are contiguous
    in either key order. The channels' means and scales come from ``kv_stats``, so no reduction over the tokens
    runs in this launch."""
    dims = tl.arange(0, D)
    mean = tl.load(v_mean_ptr + head * D + dims)
    inv = _reciprocal(tl.load(v_scale_ptr + head * D + dims))
    start = tl.load(cu_ptr + seq)
    length = tl.load(cu_ptr + seq + 1) - start
    first = vt_start(seq, start)
    span = vt_start(seq + 1, start + length) - first
    if local < span:
        cols = tl.arange(0, BLOCK_T)  # local is a multiple of 16: the key order permutes within the tile
        keys = local + (mma_column_key(cols) if MMA_KEY_ORDER else cols)
        ok = keys < length
        x = tl.load(v_ptr + (start + keys)[:, None].to(tl.int64) * stride_t + head * stride_h + dims[None, :],
                    mask=ok[:, None], other=0.0)
        y = (x.to(tl.float32) - mean[None, :]) * inv[None, :]  # V less its mean (smooth_v)
        y = tl.where(ok[:, None], _on_fp8_grid(tl.clamp(y, -448.0, 448.0), NATIVE), 0.0)  # zeros, whatever the scale
        vq = tl.trans(y.to(tl.float8e4nv) if NATIVE else y.to(tl.float16))  # [channels, columns]
        v_rows = vt_ptr + (head * D + dims)[:, None].to(tl.int64) * vt_stride
        tl.store(v_rows + (first + local + cols)[None, :], vq, mask=(local + cols < span)[None, :])


@triton.jit
def _kv_stats_span(k_ptr, k_stride_t, k_stride_h, v_ptr, stride_t, stride_h, stats_ptr, tickets_ptr, span, head,
                   tokens, span_rows, spans, k_step, HKV: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                   STAGES: tl.constexpr, SMOOTH_K: tl.constexpr):
    """One (span of ``span_rows`` tokens, head) of V: its per-channel sum, min and max (NaN kept), and with
    ``SMOOTH_K`` the sum of K's sampled rows (every ``k_step``-th key, ``reference.key_mean``'s), in slot
    ``[span, head]`` of the partials ``[4 (V's sum, min, max, K's sum), spans, heads, dim]`` that follow the stats.
    Each thread keeps its own elements' running sums and extremes, reduced across the tile once at the end: a
    reduction over the tokens per step (through shared memory) took longer than the pass itself. K's rows left out
    of the sample are masked, so they are not read.

    The head's last span to finish folds them all (``_kv_stats_fold``): each span takes a ticket from the head's
    counter once its partials are stored, and the one that draws the last ticket knows every other span's are
    written. No program waits on another, so none depends on which run at the same time."""
    dims = tl.arange(0, D)
    total = tl.zeros((BLOCK_T, D), tl.float32)
    k_total = tl.zeros((BLOCK_T, D), tl.float32)
    lo = tl.full((BLOCK_T, D), float("inf"), tl.float32)
    hi = tl.full((BLOCK_T, D), float("-inf"), tl.float32)
    first = span * span_rows
    end = tl.minimum(first + span_rows, tokens)
    for start in tl.range(first, end, BLOCK_T, num_stages=STAGES):  # loads issued STAGES - 1 steps ahead
        rows = start + tl.arange(0, BLOCK_T)
        ok = (rows < end)[:, None]
        x = tl.load(v_ptr + rows[:, None].to(tl.int64) * stride_t + head * stride_h + dims[None, :], mask=ok,
                    other=0.0).to(tl.float32)
        total += x
        lo = tl.minimum(lo, tl.where(ok, x, float("inf")), propagate_nan=tl.PropagateNan.ALL)
        hi = _maximum_nan(hi, tl.where(ok, x, float("-inf")))
        if SMOOTH_K:
            sampled = ok & ((rows % k_step) == 0)[:, None]
            k_total += tl.load(k_ptr + rows[:, None].to(tl.int64) * k_stride_t + head * k_stride_h + dims[None, :],
                               mask=sampled, other=0.0).to(tl.float32)
    parts_ptr = stats_ptr + 5 * HKV * D
    slot = (span * HKV + head) * D + dims
    plane = spans * HKV * D
    tl.store(parts_ptr + slot, tl.sum(total, 0))
    tl.store(parts_ptr + plane + slot, -max_nan(-lo, 0))
    tl.store(parts_ptr + 2 * plane + slot, max_nan(hi, 0))
    if SMOOTH_K:
        tl.store(parts_ptr + 3 * plane + slot, tl.sum(k_total, 0))
    tl.debug_barrier()  # every thread's partials stored before the ticket (acq_rel) publishes them
    if tl.atomic_add(tickets_ptr + head, 1, sem="acq_rel") == spans - 1:
        _kv_stats_fold(parts_ptr, stats_ptr, head, spans, tokens, (tokens + k_step - 1) // k_step, HKV, D, SMOOTH_K)
        tl.store(tickets_ptr + head, 0)  # ready for the next call


@triton.jit
def _kv_stats_fold(parts_ptr, stats_ptr, head, spans, tokens, k_count, HKV: tl.constexpr, D: tl.constexpr,
                   SMOOTH_K: tl.constexpr):
    """One head: the spans' partials folded in span order (so every run gives the same bits) into the stats
    ``[5 (K's sampled mean, V's mean, min, max, channel scales), heads, dim]``; K's mean is 0 in a channel where
    it is not finite, as ``reference.key_mean``'s. The partials are read past L1 (``.cg``): other SMs wrote them."""
    dims = tl.arange(0, D)
    plane = spans * HKV * D
    total = tl.zeros((D,), tl.float32)
    k_total = tl.zeros((D,), tl.float32)
    lo = tl.full((D,), float("inf"), tl.float32)
    hi = tl.full((D,), float("-inf"), tl.float32)
    for span in range(0, spans):
        slot = parts_ptr + (span * HKV + head) * D + dims
        total += tl.load(slot, cache_modifier=".cg")
        lo = tl.minimum(lo, tl.load(slot + plane, cache_modifier=".cg"), propagate_nan=tl.PropagateNan.ALL)
        hi = _maximum_nan(hi, tl.load(slot + 2 * plane, cache_modifier=".cg"))
        if SMOOTH_K:
            k_total += tl.load(slot + 3 * plane, cache_modifier=".cg")
    mean = tl.math.div_rn(total, tokens.to(tl.float32))
    out = head * D + dims
    stats_plane = HKV * D
    tl.store(stats_ptr + stats_plane + out, mean)
    tl.store(stats_ptr + 2 * stats_plane + out, lo)
    tl.store(stats_ptr + 3 * stats_plane + out, hi)
    # max |fl(x - mean)| over V is max(fl(max - mean), fl(mean - min)) exactly (rounding is monotone and symmetric)
    tl.store(stats_ptr + 4 * stats_plane + out, _amax_scale(_maximum_nan(hi - mean, mean - lo), _FP8_MAX))
    if SMOOTH_K:
        k_mean = tl.math.div_rn(k_total, k_count.to(tl.float32))
        finite = tl.abs(k_mean) < float("inf")  # (False for NaN too)
        tl.store(stats_ptr + out, tl.where(finite, k_mean, 0.0))


@dataclass
class KVStats:
    """What the quantizer needs over every token before quantizing K and V, ``[kv_heads, dim]`` float32 each: K's
    sampled mean (``smooth_k``; None without it), V's mean (``smooth_v``), extremes and fp8 channel scales."""

    k_mean: torch.Tensor | None
    v_mean: torch.Tensor
    v_min: torch.Tensor
    v_max: torch.Tensor
    v_scale: torch.Tensor


#: Per device and stream, one counter per kv head of the statistics spans that have stored their partials, 0
#: between calls (the program that folds a head's spans resets its counter): allocated once, again only for more
#: kv heads. Calls on one stream run one after another; calls on two streams (two threads serving one GPU) each
#: have their own, or their tickets would mix (torch draws streams from a fixed pool per device, so few are kept).
_TICKETS: dict[tuple[torch.device, int], torch.Tensor] = {}
_MIN_TICKETS = 256


def _tickets(device: torch.device, kv_heads: int) -> torch.Tensor:
    """The span counters of ``device`` (a tensor's: its index is set) and torch's current stream there, for at
    least ``kv_heads`` heads."""
    stream = cuda_jit.current_stream(device) if device.type == "cuda" else 0
    tickets = _TICKETS.get((device, stream))
    if tickets is None or len(tickets) < kv_heads:
        size = max(kv_heads, _MIN_TICKETS)
        tickets = _TICKETS[device, stream] = torch.zeros(size, dtype=torch.int32, device=device)
    return tickets


def _aligned(n: int) -> int:
    """``n`` floats rounded up to 128 bytes: where the next part of a shared allocation may start."""
    return cdiv(n, 32) * 32


def kv_stats(k: torch.Tensor, v: torch.Tensor, smooth_k: bool) -> KVStats:
    """``KVStats`` of packed ``[tokens, kv_heads, dim]`` K and V: the first launch's statistics programs alone
    (``sage_quantize_triton`` runs them beside Q's tiles, for tests and timing). V's mean is
    ``reference.channel_mean``'s and K's ``reference.key_mean``'s up to fp32 rounding (summed in spans), not bit
    for bit (``reference.sage_quantize`` takes both as given)."""
    tokens, kv_heads, dim = v.shape
    spans = cdiv(tokens, V_STATS_ROWS)
    stats = torch.empty((5 + 4 * spans) * kv_heads * dim, dtype=torch.float32, device=v.device)
    launch(
        _q_and_stats_kernel, (spans * kv_heads,),  # no Q: K's pointers and zeros in its place, unread
        k, k, v, k, stats, stats, _tickets(v.device, kv_heads), stats, 0, 1, 1, tokens, V_STATS_ROWS, spans,
        max(1, tokens // KEY_MEAN_SAMPLE), 0, 0, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        H=kv_heads, HKV=kv_heads, D=dim, BLOCK_T=QUANT_BLOCK_T, Q_BS=1, QMAX=127, IS_INT8=True, NATIVE=False,
        SMOOTH_K=smooth_k, STATS_BLOCK_T=V_STATS_BLOCK_T, STATS_STAGES=V_STATS_STAGES, DO_Q=False,
        num_warps=QUANT_WARPS,
    )
    k_mean, v_mean, v_min, v_max, v_scale = stats[:5 * kv_heads * dim].view(5, kv_heads, dim).unbind(0)
    return KVStats(k_mean if smooth_k else None, v_mean, v_min, v_max, v_scale)


def quant_launches(kv_tokens: int) -> tuple[str, ...]:
    """The parts of the launches after the first (K's and V's tiles) for a call of ``kv_tokens`` keys."""
    return QUANT_SHORT_LAUNCHES if kv_tokens <= QUANT_ONE_LAUNCH_TOKENS else QUANT_LAUNCHES


def launch_warps(parts: str, block_k: int) -> int:
    """Warps per program of a quantizer launch of ``parts`` (K tiles of ``block_k`` tokens): ``QUANT_WARPS`` per
    ``QUANT_BLOCK_T`` tokens of its longest tiles."""
    return QUANT_WARPS * (block_k // QUANT_BLOCK_T if "k" in parts else 1)


def sage_quantize_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, quant: QuantConfig,
    mma_key_order: bool = False,
) -> TritonSage:
    """Quantize packed ``[tokens, heads, dim]`` Q, K, V for the ``triton`` route (``mma_key_order``: in the
    ``sage-sm90`` kernel's key order; ``quant.k_block_size`` None: ``DEFAULT_K_BLOCK``).

    Everything but the tensors is worked out once per call shape (``_QuantPlan``): a repeat call allocates its
    outputs and makes its launches, with none of the arguments' checks and sizes again (issue 57: the host time
    before the first launch is a short call's on an idle GPU)."""
    device = q.device
    key = (q.shape, k.shape, q.stride(), k.stride(), v.stride(), q.dtype, layout.q_lens, layout.kv_lens, quant,
           mma_key_order, device, cuda_jit.current_stream(device) if device.type == "cuda" else 0,
           # the module's settings a plan is made with (a sweep or a test that sets one gets a plan of its own)
           QUANT_BLOCK_T, QUANT_WARPS, QUANT_ONE_LAUNCH_TOKENS, QUANT_LAUNCHES, QUANT_SHORT_LAUNCHES, V_STATS_ROWS,
           V_STATS_BLOCK_T, V_STATS_STAGES, KEY_MEAN_SAMPLE)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _QuantPlan(q, k, v, layout, quant.with_k_block(DEFAULT_K_BLOCK), mma_key_order)
        _bounded_put(_PLANS, key, plan, _MAX_PLANS)
    return plan(q, k, v, layout)


#: The quantizer's plans by call shape (``sage_quantize_triton``'s key), the oldest dropped past ``_MAX_PLANS``.
_PLANS: dict[tuple, "_QuantPlan"] = {}
_MAX_PLANS = 256


class _QuantPlan:
    """The sizes, views and launches of quantizer calls of one shape: Q, K and V's shapes, strides and dtype, the
    layout's lengths, the quant config, the key order, device and stream. The first call checks the arguments."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, quant: QuantConfig,
                 mma_key_order: bool) -> None:
        tokens_kv, kv_heads, dim = k.shape
        heads = q.shape[1]
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.stride(-1) != 1:
                raise ValueError(f"SAGE quantization needs a unit stride on the head dim of {name}; got {tuple(x.stride())}.")
        device = q.device
        native = fp8_native(device)
        self.qk_dtype = quant.qk_dtype
        if self.qk_dtype == torch.float8_e4m3fn and device.type == "cuda" and not native:
            raise ValueError("quant.dtype_qk='fp8_e4m3' needs an SM89+ GPU; use dtype_qk='int8'.")
        self.mma_key_order, self.smooth_k = mma_key_order, quant.smooth_k
        self.stats_shape, self.stats = (5, kv_heads, dim), 5 * kv_heads * dim
        self.tickets = _tickets(device, kv_heads)
        n_q_blocks = scale_slots(layout.q_lens, quant.q_block_size)
        n_k_blocks = scale_slots(layout.kv_lens, quant.k_block_size, quant.k_per_thread)
        spans = cdiv(tokens_kv, V_STATS_ROWS)
        # One float32 allocation for the small buffers: the stats [5, kv_heads, dim] (smooth_v always,
        # docs/design.md, "V's mean"), the spans' partials after them, then Q's and K's scales.
        q_scale_at = _aligned((5 + 4 * spans) * kv_heads * dim)
        k_scale_at = q_scale_at + _aligned(heads * n_q_blocks)
        self.floats = k_scale_at + kv_heads * n_k_blocks
        self.q_scale = ((heads, n_q_blocks), (n_q_blocks, 1), q_scale_at)  # as_strided's arguments
        self.k_scale = ((kv_heads, n_k_blocks), (n_k_blocks, 1), k_scale_at)
        padded = vt_start.fn(layout.num_seqs, tokens_kv)
        self.vt_shape = (kv_heads * dim, padded)
        self.vt_dtype = torch.float8_e4m3fn if native else torch.float16
        # The outputs stand in for this call's in the bound launches (their places, not their values, are kept).
        qo, ko = torch.empty(0, dtype=self.qk_dtype), torch.empty(0, dtype=self.qk_dtype)
        vt, floats = torch.empty(0, dtype=self.vt_dtype), torch.empty(0, dtype=torch.float32)
        is_int8 = self.qk_dtype == torch.int8
        # Launch 1: the stats' spans, then Q tiles of QUANT_BLOCK_T tokens.
        n_q_tiles = cdiv(layout.max_seqlen_q, QUANT_BLOCK_T)
        self.first = BoundLaunch(
            _q_and_stats_kernel, (spans * kv_heads + n_q_tiles * layout.num_seqs * heads,),
            q, k, v, qo, floats, floats, self.tickets, layout.cu_seqlens_q,
            n_q_blocks, n_q_tiles, layout.num_seqs, tokens_kv, V_STATS_ROWS, spans,
            max(1, tokens_kv // KEY_MEAN_SAMPLE), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), H=heads, HKV=kv_heads, D=dim, BLOCK_T=QUANT_BLOCK_T, Q_BS=quant.q_block_size,
            QMAX=quant.qk_max, IS_INT8=is_int8, NATIVE=native, SMOOTH_K=quant.smooth_k, STATS_BLOCK_T=V_STATS_BLOCK_T,
            STATS_STAGES=V_STATS_STAGES, DO_Q=True, num_warps=QUANT_WARPS, **_UNFUSED,
        )
        # Then K tiles of at least a K block (a tile starts whole blocks: _quantize_tile), V tiles of QUANT_BLOCK_T
        # columns over a sequence's keys and the gap after them.
        block_k = max(QUANT_BLOCK_T, quant.k_block_size)
        n_k_tiles = cdiv(layout.max_seqlen_kv, block_k)
        n_v_tiles = cdiv(layout.max_seqlen_kv + VT_GAP_MAX, QUANT_BLOCK_T)
        self.rest = []
        for parts in quant_launches(tokens_kv):
            tiles = (n_k_tiles if "k" in parts else 0, n_v_tiles if "v" in parts else 0)
            self.rest.append(BoundLaunch(
                _kv_quant_kernel, (sum(tiles) * layout.num_seqs * kv_heads,),
                k, v, ko, vt, floats, floats, layout.cu_seqlens_kv,
                n_k_blocks, *tiles, padded, layout.num_seqs, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                HKV=kv_heads, D=dim, BLOCK_T=QUANT_BLOCK_T, BLOCK_K=block_k, K_BS=quant.k_block_size,
                QMAX=quant.qk_max, IS_INT8=is_int8, SMOOTH_K=quant.smooth_k, NATIVE=native,
                MMA_KEY_ORDER=mma_key_order, K_PER_THREAD=quant.k_per_thread, DO_K="k" in parts, DO_V="v" in parts,
                num_warps=launch_warps(parts, block_k), **_UNFUSED,
            ))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout) -> TritonSage:
        device = q.device
        floats = torch.empty(self.floats, dtype=torch.float32, device=device)
        qo = torch.empty(q.shape, dtype=self.qk_dtype, device=device)
        q_scale = floats.as_strided(*self.q_scale)
        self.first(q, k, v, qo, q_scale, floats, self.tickets, layout.cu_seqlens_q)
        ko = torch.empty(k.shape, dtype=self.qk_dtype, device=device)
        vt = torch.empty(self.vt_shape, dtype=self.vt_dtype, device=device)
        k_scale = floats.as_strided(*self.k_scale)
        for bound in self.rest:
            bound(k, v, ko, vt, k_scale, floats, layout.cu_seqlens_kv)
        k_mean, v_mean, _, _, v_scale = floats[:self.stats].view(self.stats_shape).unbind(0)
        return TritonSage(q=qo, k=ko, vt=vt, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, v_mean=v_mean,
                          mma_key_order=self.mma_key_order, k_mean=k_mean if self.smooth_k else None)
