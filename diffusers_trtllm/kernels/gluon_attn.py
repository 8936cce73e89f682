"""``gluon`` route: an FA3-style Hopper (SM90) attention kernel written in Triton's Gluon.

Same semantics as ``triton_attn`` (ragged ``[tokens, heads, dim]`` with ``cu_seqlens``,
non-causal, GQA, head dim 64/128, log2-domain online softmax, the skip-softmax tile
rule, SAGE int8 QK with per-block scales and fp8 ``448 * p`` times fp8 ``V^T`` with
per-channel scales and its mean added back, reading ``triton_quant``'s layouts), with the schedule written out
explicitly instead of left to Triton's pipeliner:

- a 1-warp *loader* partition streams K and V tiles with TMA into a ``STAGES``-deep
  shared-memory ring (``k_ready``/``v_ready`` mbarriers per stage; ``empty`` is
  arrived by every consumer when it is done with a stage);
- ``CONSUMERS`` (1 or 2) *consumer* warpgroups, each owning its own ``BLOCK_M``-row Q
  tile: async ``warpgroup_mma`` for ``Q K^T``, the softmax / skip decision in registers,
  then ``warpgroup_mma`` for ``P V`` with P from registers. With two consumers the
  warp scheduler interleaves one warpgroup's softmax with the other's tensor-core
  work (FA3's ping-pong, without explicit named-barrier ordering). ``GluonConfig.schedule``
  picks the order inside a consumer: in order, with the next ``Q K^T`` in flight during the
  softmax (``lookahead``), or FA3's intra-warpgroup pipelining (``fa3``).

The skip rule's tiles are ``BLOCK_M x BLOCK_N`` (one consumer's Q tile by one KV tile),
so the reference with ``tile_q = BLOCK_M, tile_kv = BLOCK_N`` counts the same tiles.
Needs Triton with ``triton.experimental.gluon`` Hopper support (3.5+; written against
3.6) and an SM90 GPU; ``benchmarks/gluon_compile_check.py`` compiles every variant
for sm_90 ahead of time without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import QuantConfig
from ..layout import PackedLayout
from ..routing.registry import AttentionCall, Capabilities, device_sm, register_route
from .reference import FP16_MAX
from .triton_attn import LOG2E, TritonAttentionOutput, TritonRoute, check_heads, kernel_operands, rows_view, tile_output

__all__ = ["GluonRoute", "GluonConfig", "gluon_attention", "gluon_missing"]


@dataclass(frozen=True)
class GluonConfig:
    """Tiles (the skip rule's ``BLOCK_M x BLOCK_N``) and the schedule's knobs."""

    block_m: int = 64
    block_n: int = 128
    stages: int = 2
    consumers: int = 2
    #: Registers per thread of the extra consumer warpgroup (setmaxnreg); the loader gets 24.
    consumer_regs: int = 232
    #: Kernel-wide register cap, from which the default partition gets what is left.
    maxnreg: int = 168
    #: Order of work inside a consumer (``SCHEDULES``): ``"inorder"`` (Q K^T, softmax, P V, each waited),
    #: ``"lookahead"`` (Q K^T of tile j + 1 runs during tile j's softmax) or ``"fa3"`` (FA3's
    #: intra-warpgroup pipelining: Q K^T of tile j and P V of tile j - 1 run during tile j's softmax).
    schedule: str = "inorder"


#: Per variant (``VARIANTS``), the fastest configuration of the H200 sweep on wan_14b_480p
#: (``benchmarks/bench_gluon.py``, ``benchmarks/results/gluon_sweep_h200.log``).
_TUNED: dict[str, GluonConfig] = {
    "dense": GluonConfig(64, 128, 3, 2, schedule="fa3"),
    "skip": GluonConfig(64, 128, 3, 2),
    "int8": GluonConfig(64, 128, 3, 2),
    "int8_skip": GluonConfig(64, 128, 3, 2),
}

SCHEDULES = ("inorder", "lookahead", "fa3")

#: Kernel variants: name -> (QUANT, SKIP) constexprs.
VARIANTS: dict[str, tuple[int, bool]] = {"dense": (0, False), "skip": (0, True), "int8": (1, False), "int8_skip": (1, True)}


def variant(sage: bool, skip: bool) -> str:
    """Name of the kernel variant (``VARIANTS``) for int8 SAGE on/off and skip-softmax on/off."""
    return next(name for name, constexprs in VARIANTS.items() if constexprs == (int(sage), skip))


def default_config(variant_name: str) -> GluonConfig:
    return _TUNED[variant_name]


try:  # optional: Gluon's Hopper module appeared in Triton 3.5
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    import triton.language as tl

    from .triton_launch import cdiv
except ImportError as exc:  # pragma: no cover - depends on the installed triton
    gluon = None
    _GLUON_MISSING: str | None = f"needs triton with Gluon's Hopper module (pip install 'triton>=3.6'): {exc}"
else:
    _GLUON_MISSING = None


def gluon_missing() -> str | None:
    """Why Gluon kernels cannot be built here (``None`` when they can)."""
    return _GLUON_MISSING


if gluon is not None:
    #: The TMA load: ``async_copy_global_to_shared`` up to Triton 3.6, ``async_load`` after (3.9 removed the old name).
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    _LOG2_P_SCALE = gl.constexpr(math.log2(448.0))
    _NEG_INF = gl.constexpr(float("-inf"))
    _FP16_MAX = gl.constexpr(FP16_MAX)  # SAGE outputs are clamped to it (NaN kept) before an fp16 store

    @gluon.jit
    def _maximum_nan(a, b):
        return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @gluon.jit
    def _max_nan(x, axis: gl.constexpr):
        """Row/column max that returns NaN where a NaN is reduced (as ``torch.amax``)."""
        return gl.reduce(x, axis, _maximum_nan)

    @gluon.jit
    def _mul_rn(a, b):
        """``a * b`` rounded once, never contracted into a later FMA (see ``triton_attn._rounded_product``)."""
        return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.float32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _loader(desc_k, desc_v, k_bufs, v_bufs, k_ready, v_ready, empty, kv_start, v_start, kv_col, n_tiles,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, QUANT: gl.constexpr):
        """TMA producer: fills stage ``j % STAGES`` with K/V tile ``j`` once every consumer released it."""
        for j in range(n_tiles):
            st = j % STAGES
            ph = (j // STAGES) & 1
            mbarrier.wait(empty.index(st), ph ^ 1)  # fresh barriers count as released
            mbarrier.expect(k_ready.index(st), desc_k.block_type.nbytes)
            _tma_load(desc_k, [kv_start + j * BLOCK_N, kv_col], k_ready.index(st), k_bufs.index(st))
            mbarrier.expect(v_ready.index(st), desc_v.block_type.nbytes)
            if QUANT == 0:
                _tma_load(desc_v, [kv_start + j * BLOCK_N, kv_col], v_ready.index(st), v_bufs.index(st))
            else:  # V^T: [kv_heads * dim, padded tokens], tokens contiguous
                _tma_load(desc_v, [kv_col, v_start + j * BLOCK_N], v_ready.index(st), v_bufs.index(st))

    @gluon.jit
    def _qk_issue(q_smem, k_buf, s_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  QUANT: gl.constexpr):
        """Start ``Q K^T`` of one tile on the tensor cores (bf16 into fp32, or int8 into int32)."""
        acc_dtype: gl.constexpr = gl.float32 if QUANT == 0 else gl.int32
        return warpgroup_mma(q_smem, k_buf.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], acc_dtype, s_layout),
                             use_acc=False, is_async=True)

    @gluon.jit
    def _qk_finish(s, kv_len, start_n, k_scale_ptr, k_scale_first, s_layout: gl.constexpr,
                   BLOCK_N: gl.constexpr, QUANT: gl.constexpr, K_BS: gl.constexpr, MASK: gl.constexpr):
        """Scores of a finished ``Q K^T`` (before the per-row factor), masked past ``kv_len`` when ``MASK``."""
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if QUANT != 0:
            # |int8 dot| < 2**22: adding 1.5 * 2**23's bit pattern makes an exact float
            s = (s + 0x4B400000).to(gl.float32, bitcast=True) - 12582912.0
            k_scale = gl.load(k_scale_ptr + k_scale_first + cols // K_BS, mask=cols < kv_len, other=0.0)
            s = _mul_rn(s, gl.expand_dims(k_scale, 0))
        if MASK:
            s = gl.where(gl.expand_dims(cols < kv_len, 0), s, _NEG_INF)
        return s

    @gluon.jit
    def _skip_decision(j, local, m_i, n_skipped, q_row_scale, row_ok, log2_lam, SKIP: gl.constexpr):
        """The skip rule for tile ``j`` (the first tile is always kept), and the running count of skips.

        Without ``SKIP`` it is the constant ``True``, so callers' ``if keep:`` vanish at compile time.
        """
        keep = True
        if SKIP:
            excess = _max_nan(gl.where(row_ok, (local - m_i) * q_row_scale, _NEG_INF), 0)
            keep = (j == 0) | (excess >= log2_lam) | (excess != excess)
            n_skipped += 1 - keep.to(gl.int32)
        return keep, n_skipped

    @gluon.jit
    def _softmax(s, local, m_i, l_i, q_row_scale, QUANT: gl.constexpr):
        """Online-softmax step: probabilities (``448 * p`` for SAGE, whose l carries the same factor),
        the rescale factor of what came before, and the new running sum and max."""
        m_new = gl.maximum(m_i, local)
        alpha = gl.exp2((m_i - m_new) * q_row_scale)
        if QUANT == 0:
            p = gl.exp2((s - gl.expand_dims(m_new, 1)) * gl.expand_dims(q_row_scale, 1))
        else:
            p = gl.exp2((s - gl.expand_dims(m_new, 1)) * gl.expand_dims(q_row_scale, 1) + _LOG2_P_SCALE)
        return p, alpha, l_i * alpha + gl.sum(p, 1), m_new

    @gluon.jit
    def _pv_issue(p_op, v_buf, acc, QUANT: gl.constexpr):
        """Start ``P V`` on the tensor cores (V tile ``[BLOCK_N, D]``, or SAGE's ``V^T`` tile ``[D, BLOCK_N]``)."""
        if QUANT == 0:
            return warpgroup_mma(p_op, v_buf, acc, is_async=True)
        else:
            return warpgroup_mma(p_op, v_buf.permute((1, 0)), acc, is_async=True)

    @gluon.jit
    def _update(j, s, acc, l_i, m_i, n_skipped, v_bufs, v_ready, empty, st, ph, q_row_scale, row_ok, log2_lam,
                o_layout: gl.constexpr, QUANT: gl.constexpr, SKIP: gl.constexpr):
        """Skip decision, online-softmax update and ``P V`` for tile ``j`` (stage ``st``), then release the stage."""
        local = _max_nan(s, 1)  # NaN rows stay NaN, so the skip rule keeps their tiles (as the reference)
        keep, n_skipped = _skip_decision(j, local, m_i, n_skipped, q_row_scale, row_ok, log2_lam, SKIP)
        mbarrier.wait(v_ready.index(st), ph)  # also when skipped: the stage is refilled only after its loads land
        if keep:
            p, alpha, l_i, m_i = _softmax(s, local, m_i, l_i, q_row_scale, QUANT)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            p_op = gl.convert_layout(p.to(gl.bfloat16 if QUANT == 0 else gl.float8e4nv),
                                     gl.DotOperandLayout(0, o_layout, 2 if QUANT == 0 else 4))
            acc = _pv_issue(p_op, v_bufs.index(st), acc, QUANT)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index(st), count=1)
        return acc, l_i, m_i, n_skipped

    @gluon.jit
    def _tile(j, acc, l_i, m_i, n_skipped, q_smem, k_bufs, v_bufs, k_ready, v_ready, empty, q_row_scale, row_ok,
              k_scale_ptr, k_scale_first, kv_len, log2_lam, s_layout: gl.constexpr, o_layout: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, QUANT: gl.constexpr,
              K_BS: gl.constexpr, MASK: gl.constexpr, SKIP: gl.constexpr):
        """One KV tile, in order: ``Q K^T``, wait, softmax, ``P V``, wait."""
        st = j % STAGES
        ph = (j // STAGES) & 1
        mbarrier.wait(k_ready.index(st), ph)
        s = _qk_issue(q_smem, k_bufs.index(st), s_layout, BLOCK_M, BLOCK_N, QUANT)
        s = warpgroup_mma_wait(0, deps=(s, ))
        s = _qk_finish(s, kv_len, j * BLOCK_N, k_scale_ptr, k_scale_first, s_layout, BLOCK_N, QUANT, K_BS, MASK)
        return _update(j, s, acc, l_i, m_i, n_skipped, v_bufs, v_ready, empty, st, ph, q_row_scale, row_ok, log2_lam,
                       o_layout, QUANT, SKIP)

    @gluon.jit
    def _lookahead_loop(acc, l_i, m_i, n_skipped, q_smem, k_bufs, v_bufs, k_ready, v_ready, empty, q_row_scale,
                        row_ok, k_scale_ptr, k_scale_first, kv_len, log2_lam, s_layout: gl.constexpr,
                        o_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                        QUANT: gl.constexpr, K_BS: gl.constexpr, SKIP: gl.constexpr):
        """Every KV tile, with ``Q K^T`` of tile ``j + 1`` on the tensor cores during tile ``j``'s softmax.

        After the last tile the look-ahead product reads the last stage again (it is still
        held), so the loop has no conditional MMA; its result is dropped.
        """
        n_tiles = gl.cdiv(kv_len, BLOCK_N)
        mbarrier.wait(k_ready.index(0), 0, pred=n_tiles > 0)  # no tiles: the product reads stale SMEM, unused
        s_next = _qk_issue(q_smem, k_bufs.index(0), s_layout, BLOCK_M, BLOCK_N, QUANT)
        for j in range(n_tiles):
            st = j % STAGES
            ph = (j // STAGES) & 1
            s = warpgroup_mma_wait(0, deps=(s_next, ))
            jn = gl.minimum(j + 1, n_tiles - 1)
            mbarrier.wait(k_ready.index(jn % STAGES), (jn // STAGES) & 1)
            s_next = _qk_issue(q_smem, k_bufs.index(jn % STAGES), s_layout, BLOCK_M, BLOCK_N, QUANT)
            s = _qk_finish(s, kv_len, j * BLOCK_N, k_scale_ptr, k_scale_first, s_layout, BLOCK_N, QUANT, K_BS, False)
            if (j + 1) * BLOCK_N > kv_len:  # the ragged last tile
                cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                s = gl.where(gl.expand_dims(cols < kv_len, 0), s, _NEG_INF)
            acc, l_i, m_i, n_skipped = _update(j, s, acc, l_i, m_i, n_skipped, v_bufs, v_ready, empty, st, ph,
                                               q_row_scale, row_ok, log2_lam, o_layout, QUANT, SKIP)
        s_next = warpgroup_mma_wait(0, deps=(s_next, ))
        return acc, l_i, m_i, n_skipped

    @gluon.jit
    def _fa3_loop(acc, l_i, m_i, n_skipped, q_smem, k_bufs, v_bufs, k_ready, v_ready, empty, q_row_scale,
                  row_ok, k_scale_ptr, k_scale_first, kv_len, log2_lam, s_layout: gl.constexpr,
                  o_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  QUANT: gl.constexpr, K_BS: gl.constexpr, SKIP: gl.constexpr):
        """Every KV tile, FA3's intra-warpgroup pipelining: while tile ``j``'s softmax runs, the tensor
        cores hold ``Q K^T`` of tile ``j`` (waited first) and ``P V`` of tile ``j - 1``.

        ``P`` of the last kept tile waits in registers (``p_prev``) for the next iteration; the
        accumulator is rescaled by tile ``j``'s ``alpha`` once ``P V`` of tile ``j - 1`` is done,
        so ``acc = (acc + P_{j-1} V_{j-1}) * alpha_j`` as in the in-order schedule. A stage is
        released once its ``P V`` (or, for a skipped tile, its V load) is done.
        """
        p_dtype: gl.constexpr = gl.bfloat16 if QUANT == 0 else gl.float8e4nv
        p_layout: gl.constexpr = gl.DotOperandLayout(0, o_layout, 2 if QUANT == 0 else 4)
        n_tiles = gl.cdiv(kv_len, BLOCK_N)
        p_prev = gl.convert_layout(gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout).to(p_dtype), p_layout)
        keep_prev = n_tiles < 0  # False, as a tensor: it is loop-carried
        for j in range(n_tiles):
            st = j % STAGES
            ph = (j // STAGES) & 1
            jp = gl.maximum(j - 1, 0)
            stp = jp % STAGES
            mbarrier.wait(k_ready.index(st), ph)
            s_tok = _qk_issue(q_smem, k_bufs.index(st), s_layout, BLOCK_M, BLOCK_N, QUANT)
            mbarrier.wait(v_ready.index(stp), (jp // STAGES) & 1, pred=j > 0)
            if keep_prev:
                acc = _pv_issue(p_prev, v_bufs.index(stp), acc, QUANT)
                s, acc = warpgroup_mma_wait(1, deps=(s_tok, acc))  # Q K^T done; P V still in flight
            else:
                s = warpgroup_mma_wait(0, deps=(s_tok, ))
            s = _qk_finish(s, kv_len, j * BLOCK_N, k_scale_ptr, k_scale_first, s_layout, BLOCK_N, QUANT, K_BS, False)
            if (j + 1) * BLOCK_N > kv_len:  # the ragged last tile
                cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                s = gl.where(gl.expand_dims(cols < kv_len, 0), s, _NEG_INF)
            local = _max_nan(s, 1)
            keep, n_skipped = _skip_decision(j, local, m_i, n_skipped, q_row_scale, row_ok, log2_lam, SKIP)
            alpha = gl.full([BLOCK_M], 1.0, gl.float32, gl.SliceLayout(1, s_layout))
            p = s  # (replaced by the probabilities when the tile is kept)
            if keep:
                p, alpha, l_i, m_i = _softmax(s, local, m_i, l_i, q_row_scale, QUANT)
            acc = warpgroup_mma_wait(0, deps=(acc, ))  # P V of tile j - 1 done
            mbarrier.arrive(empty.index(stp), count=1, pred=j > 0)
            if keep:  # only now: P V of tile j - 1 was reading p_prev's registers
                p_prev = gl.convert_layout(p.to(p_dtype), p_layout)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            keep_prev = gl.to_tensor(keep)
        if n_tiles > 0:  # P V of the last tile
            last = n_tiles - 1
            mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
            if keep_prev:
                acc = _pv_issue(p_prev, v_bufs.index(last % STAGES), acc, QUANT)
                acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(empty.index(last % STAGES), count=1)
        return acc, l_i, m_i, n_skipped

    @gluon.jit
    def _consumer(desc_q, out_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, v_mean_ptr, stats_ptr, q_bufs, q_bars,
                  k_bufs, v_bufs, k_ready, v_ready, empty, q_start, q_len, cta_m0, kv_len, head, kv_head,
                  n_q_blocks, n_k_blocks, kv_start, seq, qk_scale, skip_factor, stride_ot, stride_oh,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  QUANT: gl.constexpr, Q_BS: gl.constexpr, K_BS: gl.constexpr, SKIP: gl.constexpr,
                  STATS: gl.constexpr, SCHEDULE: gl.constexpr, WG: gl.constexpr):
        """Consumer warpgroup ``WG``: its Q tile (rows ``m0 .. m0 + BLOCK_M`` of the sequence) over every KV tile."""
        m0 = cta_m0 + WG * BLOCK_M
        q_smem = q_bufs.index(WG)
        q_bar = q_bars.index(WG)
        K_QK: gl.constexpr = 16 if QUANT == 0 else 32
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, K_QK])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, K_QK])
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        mbarrier.expect(q_bar, desc_q.block_type.nbytes)
        _tma_load(desc_q, [q_start + m0, head * HEAD_DIM], q_bar, q_smem)

        rows = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
        row_ok = rows < q_len
        if QUANT == 0:
            q_row_scale = gl.zeros([BLOCK_M], gl.float32, row_layout) + qk_scale
            k_scale_first = 0
        else:
            q_first = head * n_q_blocks + q_start // Q_BS + seq
            q_row_scale = gl.load(q_scale_ptr + q_first + rows // Q_BS, mask=row_ok, other=1.0) * qk_scale
            k_scale_first = kv_head * n_k_blocks + kv_start // K_BS + seq
        log2_lam = gl.log2(skip_factor / kv_len.to(gl.float32))  # -inf when skip_factor == 0
        m_i = gl.full([BLOCK_M], _NEG_INF, gl.float32, row_layout)
        l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        n_skipped = gl.to_tensor(0)
        mbarrier.wait(q_bar, 0)

        if SCHEDULE == 2:
            acc, l_i, m_i, n_skipped = _fa3_loop(
                acc, l_i, m_i, n_skipped, q_smem, k_bufs, v_bufs, k_ready, v_ready, empty, q_row_scale, row_ok,
                k_scale_ptr, k_scale_first, kv_len, log2_lam, s_layout, o_layout,
                BLOCK_M, BLOCK_N, STAGES, QUANT, K_BS, SKIP)
        elif SCHEDULE == 1:
            acc, l_i, m_i, n_skipped = _lookahead_loop(
                acc, l_i, m_i, n_skipped, q_smem, k_bufs, v_bufs, k_ready, v_ready, empty, q_row_scale, row_ok,
                k_scale_ptr, k_scale_first, kv_len, log2_lam, s_layout, o_layout,
                BLOCK_M, BLOCK_N, STAGES, QUANT, K_BS, SKIP)
        else:
            n_full = kv_len // BLOCK_N
            for j in range(n_full):
                acc, l_i, m_i, n_skipped = _tile(
                    j, acc, l_i, m_i, n_skipped, q_smem, k_bufs, v_bufs, k_ready, v_ready, empty, q_row_scale,
                    row_ok, k_scale_ptr, k_scale_first, kv_len, log2_lam, s_layout, o_layout,
                    BLOCK_M, BLOCK_N, STAGES, QUANT, K_BS, False, SKIP)
            if n_full * BLOCK_N < kv_len:  # the ragged last tile, masked
                acc, l_i, m_i, n_skipped = _tile(
                    n_full, acc, l_i, m_i, n_skipped, q_smem, k_bufs, v_bufs, k_ready, v_ready, empty, q_row_scale,
                    row_ok, k_scale_ptr, k_scale_first, kv_len, log2_lam, s_layout, o_layout,
                    BLOCK_M, BLOCK_N, STAGES, QUANT, K_BS, True, SKIP)

        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)
        l_o = gl.convert_layout(l_i, o_rows)
        o = acc / gl.expand_dims(gl.where(l_o > 0.0, l_o, 1.0), 1)
        dims = gl.arange(0, HEAD_DIM, layout=o_cols)
        if QUANT != 0:
            vc = kv_head * HEAD_DIM + dims  # V's scales, then its mean (smooth_v) back
            o = o * gl.expand_dims(gl.load(v_scale_ptr + vc), 0) + gl.expand_dims(gl.load(v_mean_ptr + vc), 0)
            if out_ptr.dtype.element_ty == gl.float16:  # fp8's rounding of V less its mean may overshoot
                o = gl.minimum(gl.maximum(o, -_FP16_MAX, propagate_nan=tl.PropagateNan.ALL), _FP16_MAX,
                               propagate_nan=tl.PropagateNan.ALL)
        out_rows = m0 + gl.arange(0, BLOCK_M, layout=o_rows)
        tok = (q_start + out_rows).to(gl.int64)
        ptrs = out_ptr + gl.expand_dims(tok * stride_ot + head * stride_oh, 1) + gl.expand_dims(dims, 0)
        gl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(out_rows < q_len, 1))
        if STATS:
            if m0 < q_len:  # only Q tiles that exist in the sequence count
                gl.atomic_add(stats_ptr, n_skipped)

    @gluon.jit
    def _attn_fwd(
        desc_q, desc_k, desc_v, out_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, v_mean_ptr, stats_ptr,
        cu_q_ptr, cu_kv_ptr, qk_scale, skip_factor, n_q_blocks, n_k_blocks, stride_ot, stride_oh,
        H: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        QUANT: gl.constexpr, Q_BS: gl.constexpr, K_BS: gl.constexpr, SKIP: gl.constexpr, STATS: gl.constexpr,
        SCHEDULE: gl.constexpr,
    ):
        cta_m0 = gl.program_id(0) * (CONSUMERS * BLOCK_M)
        seq = gl.program_id(1) // H
        head = gl.program_id(1) % H
        kv_head = head // GROUP
        q_start = gl.load(cu_q_ptr + seq)
        q_len = gl.load(cu_q_ptr + seq + 1) - q_start
        kv_start = gl.load(cu_kv_ptr + seq)
        kv_len = gl.load(cu_kv_ptr + seq + 1) - kv_start
        kv_len = gl.where(cta_m0 < q_len, kv_len, 0)  # a CTA past this sequence's queries does no work
        n_tiles = gl.cdiv(kv_len, BLOCK_N)
        kv_col = kv_head * HEAD_DIM
        v_start = 16 * (kv_start // 16 + 2 * seq)  # triton_quant.vt_start

        q_smem = gl.allocate_shared_memory(desc_q.dtype, [CONSUMERS] + desc_q.block_type.shape, desc_q.layout)
        k_bufs = gl.allocate_shared_memory(desc_k.dtype, [STAGES] + desc_k.block_type.shape, desc_k.layout)
        v_bufs = gl.allocate_shared_memory(desc_v.dtype, [STAGES] + desc_v.block_type.shape, desc_v.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(CONSUMERS):
            mbarrier.init(q_bar.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=CONSUMERS)

        # (argument tuples are written inline: a tuple bound to a name turns its constexprs into tensors)
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_consumer, (desc_q, out_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, v_mean_ptr, stats_ptr, q_smem, q_bar,
                               k_bufs, v_bufs, k_ready, v_ready, empty, q_start, q_len, cta_m0, kv_len, head, kv_head,
                               n_q_blocks, n_k_blocks, kv_start, seq, qk_scale, skip_factor, stride_ot, stride_oh,
                               HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, QUANT, Q_BS, K_BS, SKIP, STATS, SCHEDULE, 0)),
                (_consumer, (desc_q, out_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, v_mean_ptr, stats_ptr, q_smem, q_bar,
                               k_bufs, v_bufs, k_ready, v_ready, empty, q_start, q_len, cta_m0, kv_len, head, kv_head,
                               n_q_blocks, n_k_blocks, kv_start, seq, qk_scale, skip_factor, stride_ot, stride_oh,
                               HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, QUANT, Q_BS, K_BS, SKIP, STATS, SCHEDULE, 1)),
                (_loader, (desc_k, desc_v, k_bufs, v_bufs, k_ready, v_ready, empty, kv_start, v_start, kv_col, n_tiles,
                           BLOCK_N, STAGES, QUANT)),
            ], [4, 1], [CONSUMER_REGS, 24])
        else:
            gl.warp_specialize([
                (_consumer, (desc_q, out_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, v_mean_ptr, stats_ptr, q_smem, q_bar,
                               k_bufs, v_bufs, k_ready, v_ready, empty, q_start, q_len, cta_m0, kv_len, head, kv_head,
                               n_q_blocks, n_k_blocks, kv_start, seq, qk_scale, skip_factor, stride_ot, stride_oh,
                               HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, QUANT, Q_BS, K_BS, SKIP, STATS, SCHEDULE, 0)),
                (_loader, (desc_k, desc_v, k_bufs, v_bufs, k_ready, v_ready, empty, kv_start, v_start, kv_col, n_tiles,
                           BLOCK_N, STAGES, QUANT)),
            ], [1], [24])


def _desc(x: torch.Tensor, block: list[int]):
    """Gluon TMA descriptor over a 2-D view, with the default swizzled layout for ``block``."""
    if x.dim() == 3:
        x = rows_view(x)
    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.int8: gl.int8,
             torch.float8_e4m3fn: gl.float8e4nv}[x.dtype]
    return TensorDescriptor.from_tensor(x, block, gl.NVMMASharedLayout.get_default_for(block, dtype))


def gluon_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: PackedLayout,
    *,
    softmax_scale: float,
    skip_factor: float | None = None,
    quant: QuantConfig | None = None,
    collect_stats: bool = False,
    return_lse: bool = False,
    config: GluonConfig | None = None,
) -> TritonAttentionOutput:
    """Attention over packed ``[tokens, heads, dim]`` bf16 tensors with the Gluon Hopper kernel.

    ``return_lse`` is accepted for ``TritonRoute.run``'s interface; the kernel does not write the
    log-sum-exp yet (the route does not claim it), so asking for it is an error.
    """
    if _GLUON_MISSING:
        raise RuntimeError(_GLUON_MISSING)
    if return_lse:
        raise ValueError("the gluon kernel does not return the log-sum-exp; use backend='triton' or 'fa3'.")
    tokens_q, heads, dim = q.shape
    kv_heads = k.shape[1]
    check_heads(q, k, "gluon")
    if q.dtype != torch.bfloat16:
        raise ValueError(f"the gluon route takes bf16 Q/K/V; got {q.dtype}. Cast, or use backend='triton'.")
    sage = quant is not None and quant.enabled
    if sage and quant.dtype_qk != "int8":
        raise ValueError(f"the gluon route's SAGE path is int8 QK; got dtype_qk={quant.dtype_qk!r}. Use backend='triton'.")
    cfg = config or default_config(variant(sage, skip_factor is not None))
    if cfg.stages < 2:
        raise ValueError(f"the gluon kernel needs at least 2 pipeline stages; got {cfg.stages}.")
    bm, bn = cfg.block_m, cfg.block_n
    out = torch.empty(tokens_q, heads, dim, dtype=q.dtype, device=q.device)
    ops = kernel_operands(q, k, v, layout, quant, out, bm, bn, describe=_desc)
    stats = torch.zeros(1, dtype=torch.int32, device=q.device) if collect_stats else out  # out: never written
    grid = (cdiv(layout.max_seqlen_q, cfg.consumers * bm), layout.num_seqs * heads)
    _attn_fwd[grid](
        *ops.descs, out, *ops.scales, stats,
        layout.cu_seqlens_q, layout.cu_seqlens_kv, softmax_scale * LOG2E,
        float(skip_factor or 0.0), *ops.n_blocks, out.stride(0), out.stride(1),
        H=heads, GROUP=heads // kv_heads, HEAD_DIM=dim, BLOCK_M=bm, BLOCK_N=bn,
        STAGES=cfg.stages, CONSUMERS=cfg.consumers, CONSUMER_REGS=cfg.consumer_regs,
        QUANT=1 if sage else 0, Q_BS=ops.block_sizes[0], K_BS=ops.block_sizes[1],
        SKIP=skip_factor is not None, STATS=collect_stats and skip_factor is not None, SCHEDULE=SCHEDULES.index(cfg.schedule),
        num_warps=4, maxnreg=cfg.maxnreg,
    )
    return tile_output(out, stats, layout, heads, bm, bn, collect_stats, skip_factor)


def compile_sm90(variant_name: str, head_dim: int = 128, config: GluonConfig | None = None):
    """Compile one kernel variant for sm_90 without a GPU (``triton.compile`` on the AST).

    Returns the compiled kernel; ``.asm["ptx"]`` / ``.asm["ttgir"]`` hold its code. Tensor
    arguments are described by CPU tensors of the right dtype, so no device is touched.
    """
    if _GLUON_MISSING:
        raise RuntimeError(_GLUON_MISSING)
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import mangle_type

    quant, skip = VARIANTS[variant_name]
    cfg = config or default_config(variant_name)
    heads, kv_heads, tokens = 4, 2, 1024
    qk = torch.empty(tokens, heads * head_dim, dtype=torch.int8 if quant else torch.bfloat16)
    kv = torch.empty(tokens, kv_heads * head_dim, dtype=qk.dtype)
    vt = torch.empty(kv_heads * head_dim, tokens, dtype=torch.float8_e4m3fn)
    descs = (_desc(qk, [cfg.block_m, head_dim]), _desc(kv, [cfg.block_n, head_dim]),
             _desc(vt, [head_dim, cfg.block_n]) if quant else _desc(kv, [cfg.block_n, head_dim]))
    out, f32, i32 = (torch.empty(16, dtype=t) for t in (torch.bfloat16, torch.float32, torch.int32))
    runtime = (*descs, out, f32, f32, f32, f32, i32, i32, i32, 0.1, 0.5, 7, 7, 512, 128)
    constexprs = dict(H=heads, GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      STAGES=cfg.stages, CONSUMERS=cfg.consumers, CONSUMER_REGS=cfg.consumer_regs,
                      QUANT=quant, Q_BS=1, K_BS=16 if quant else 1, SKIP=skip, STATS=skip,
                      SCHEDULE=SCHEDULES.index(cfg.schedule))
    names = _attn_fwd.arg_names
    signature = {name: mangle_type(arg) for name, arg in zip(names, runtime)}
    signature.update({name: "constexpr" for name in constexprs})
    src = gluon._runtime.GluonASTSource(_attn_fwd, signature, constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 128), options=dict(num_warps=4, maxnreg=cfg.maxnreg))


class GluonRoute(TritonRoute):
    """The Gluon FA3-style kernel (SM90 only). ``auto`` picks it for skip-softmax without SAGE, where it
    measured fastest on the H200 (wan_14b_480p / 720p at 50% skipped: 1.16x / 1.17x cuDNN against
    FMHAv2's 1.12x / 1.12x; a Wan-14B forward with skip alone at 53% skipped: 1.104x stock against
    FMHAv2's 1.082x; ``benchmarks/results/gluon_h200.md``, ``e2e_h200_gluon.md``, ``e2e_h200.md``),
    and where its GPU tests, extreme magnitudes and NaN included, pass
    (``benchmarks/results/gpu_tests_h200_run10_gluon_triton.log``). Dense work is fa3's and int8 SAGE
    the ``triton`` kernel's (0.91-0.96x against 1.10-1.13x). It returns no log-sum-exp, so a ring
    shard's skip alone takes FMHAv2."""

    name = "gluon"
    attention = staticmethod(gluon_attention)
    caps = Capabilities(
        min_sm=90,
        head_dims=frozenset({64, 128}),
        skip_softmax=True,
        sage_dtypes=frozenset({"int8"}),
    )

    def extra_reasons(self, call: AttentionCall) -> list[str]:
        reasons = []
        if _GLUON_MISSING:
            reasons.append(_GLUON_MISSING)
        sm = device_sm(call.q.device)
        if sm is not None and sm != 90:
            reasons.append(f"the gluon kernel is written for Hopper (sm_90); this GPU is sm_{sm}")
        if call.q.dtype != torch.bfloat16:
            reasons.append(f"the gluon kernel takes bf16 inputs; got {call.q.dtype}")
        return reasons


register_route(GluonRoute())
