"""Rotary position embedding over interleaved pairs, Q and K in one launch (Wan's, Flux's and Qwen-Image's rules).

These families' processors turn each pair ``(x[2j], x[2j + 1])`` of a head by an angle read from float32 tables
``freqs_cos``, ``freqs_sin`` of the head's width, in float32, rounded back to ``x``'s dtype::

    out[2j]     = x[2j] * C_E - x[2j + 1] * S_E
    out[2j + 1] = x[2j] * S_O + x[2j + 1] * C_O

They differ in which entries they read and how they round (``rule``): ``"pair"`` (Wan's processor) one cosine and one
sine per pair, C_E = C_O = ``freqs_cos[..., 2j]`` and S_E = S_O = ``freqs_sin[..., 2j + 1]``; ``"element"``
(Diffusers' ``apply_rotary_emb`` with ``use_real_unbind_dim=-1``, which Flux calls) each output its own entries,
C_E, S_E at ``2j`` and C_O, S_O at ``2j + 1``; ``"complex"`` (Qwen-Image's ``apply_rotary_emb_qwen(...,
use_real=False)``: each pair a complex number times a table entry ``c + i s``) the entries ``"pair"`` reads, from a
complex table viewed as float32 pairs (``c`` at ``2j``, ``s`` at ``2j + 1``) passed as both tables, rounded as
torch's complex multiply rounds on CUDA: ``fma(x[2j], c, -(x[2j + 1] * s))`` and ``fma(x[2j], s, x[2j + 1] * c)``,
c10::complex's ``a * c - b * d`` and ``a * d + b * c`` as torch's CUDA build contracts them (found on an H200
against torch's own product). Eager torch spends seven or eight launches a tensor on the first two through float32
intermediates (three on Qwen-Image's): 5.8 ms of each self-attention call of a Wan2.1-14B 480p forward on an H100,
against 0.6 ms here (docs/design.md, "Rotary embeddings in one launch"). :func:`rotate_interleaved` does Q and K in
one Triton launch that reads each once and writes each once, bit for bit the same values: every product and sum is
rounded on its own, as torch's separate launches round them (no fused multiply-add but the complex rule's two; a
sum's operands may be swapped, which IEEE addition does not see, and Flux's ``x * c + (-y) * s`` is exactly
``x * c - y * s``), and the cast rounds to nearest even. Elsewhere (CPU, ``torch.compile``, whose Inductor fuses the
torch form itself, or inputs outside the kernel's layout) :func:`rotate_interleaved_reference` computes the same in
torch (under ``"complex"``, torch's complex multiply on the tensors' own device).

Tables of ``R`` tokens, fewer than Q and K hold, turn the window of ``R`` tokens from ``start`` (0 unless given) and
leave the rest as they are, in the same launch: HunyuanVideo's processors rotate the video tokens of a joint sequence
whose text tokens follow them (``start`` 0), CogVideoX's the video tokens after the text's (``start`` the text's
length).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from .triton_launch import cdiv, launch
except ImportError:  # the torch form serves every call
    triton = None

__all__ = ["RULES", "rotate_interleaved", "rotate_interleaved_reference", "fused_rotary_reasons"]

#: Which table entries a pair's outputs read (module docstring).
RULES = ("pair", "element", "complex")

#: Tokens per program: with 128-dim heads, each head's step moves a 4 KB tile of Q or K in and out.
ROTARY_BLOCK_S = 16
_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def rotate_interleaved_reference(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor,
                                 rule: str = "pair", start: int = 0) -> torch.Tensor:
    """``x`` ``[B, S, H, D]`` turned pair by pair under ``rule``, in torch (the tables broadcast against ``x``; tables
    ``[.., R, 1, D]`` of ``R < S`` tokens turn tokens ``start`` to ``start + R`` and keep the rest)."""
    _check_rule(rule)
    _check_window(x, freqs_cos, start)
    if x.ndim == 4 and freqs_cos.ndim == 4 and (rotated := freqs_cos.shape[1]) < x.shape[1]:
        end = start + rotated
        window = rotate_interleaved_reference(x[:, start:end], freqs_cos, freqs_sin, rule)
        return torch.cat((x[:, :start], window, x[:, end:]), dim=1)
    if rule == "complex":  # torch's complex multiply, as the family runs it on this device
        table = torch.complex(freqs_cos[..., 0::2], freqs_sin[..., 1::2])
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * table).flatten(-2).to(x.dtype)
    first, second = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos_e, cos_o = freqs_cos[..., 0::2], freqs_cos[..., 1::2]
    sin_e, sin_o = freqs_sin[..., 0::2], freqs_sin[..., 1::2]
    if rule == "pair":
        cos_o, sin_e = cos_e, sin_o
    turned = torch.stack((first * cos_e - second * sin_e, first * sin_o + second * cos_o), dim=-1)
    return turned.flatten(-2).to(x.dtype)


def _check_rule(rule: str) -> None:
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}; got {rule!r}.")


def _check_window(query: torch.Tensor, freqs_cos: torch.Tensor, start: int) -> None:
    """Tables of ``R`` tokens from token ``start`` must lie inside Q's ``S``."""
    if query.ndim == freqs_cos.ndim == 4:
        fits = 0 <= start <= query.shape[1] - freqs_cos.shape[1]
    else:  # tables broadcast against Q: no window
        fits = start == 0
    if not fits:
        raise ValueError(f"start {start}: [.., R, 1, D] tables turn tokens start to start + R of Q's [B, S, H, D], "
                         f"so they must fit (0 <= start <= S - R); got Q {tuple(query.shape)}, tables "
                         f"{tuple(freqs_cos.shape)}.")


def fused_rotary_reasons(query: torch.Tensor, key: torch.Tensor, freqs_cos: torch.Tensor,
                         freqs_sin: torch.Tensor) -> list[str]:
    """Why the one-launch kernel cannot rotate these tensors (empty: it can)."""
    reasons = []
    if triton is None:
        reasons.append("needs the triton package")
    if not (query.is_cuda and key.is_cuda and freqs_cos.is_cuda and freqs_sin.is_cuda):
        reasons.append("needs CUDA tensors")
    if torch.compiler.is_compiling():
        reasons.append("under torch.compile (Inductor fuses the torch form)")
    if query.dtype != key.dtype or query.dtype not in _FUSED_DTYPES:
        reasons.append(f"Q and K must share one of {_FUSED_DTYPES}; got {query.dtype}, {key.dtype}")
    if freqs_cos.dtype != torch.float32 or freqs_sin.dtype != torch.float32:
        reasons.append(f"frequencies must be float32; got {freqs_cos.dtype}, {freqs_sin.dtype}")
    if query.ndim != 4 or key.ndim != 4 or freqs_cos.ndim != 4 or freqs_sin.shape != freqs_cos.shape:
        reasons.append("Q and K must be [B, S, H, D] and the frequencies [1 or B, S or fewer, 1, D]")
        return reasons
    batch, tokens, _, dim = query.shape
    if key.shape[0] != batch or key.shape[1] != tokens or key.shape[3] != dim:
        reasons.append(f"K {tuple(key.shape)} must have Q's batch, tokens and head dim {tuple(query.shape)}")
    if (freqs_cos.shape[0] not in (1, batch) or freqs_cos.shape[1] > tokens
            or tuple(freqs_cos.shape[2:]) != (1, dim)):
        reasons.append(f"frequencies {tuple(freqs_cos.shape)} must be [1 or {batch}, at most {tokens}, 1, {dim}]")
    if dim < 2 or dim & (dim - 1):
        reasons.append(f"head dim {dim} must be a power of two")
    if any(t.stride(-1) != 1 for t in (query, key, freqs_cos, freqs_sin)):
        reasons.append("the head dim must be contiguous in Q, K and the frequencies")
    return reasons


def rotate_interleaved(query: torch.Tensor, key: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor,
                       rule: str = "pair", start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Q and K ``[B, S, H, D]`` (their own head counts) turned by ``[1 or B, R, 1, D]`` float32 tables under ``rule``
    (``R < S``: tokens ``start`` to ``start + R``; the rest kept); new contiguous tensors, one launch where
    ``fused_rotary_reasons`` finds nothing against it."""
    _check_rule(rule)
    _check_window(query, freqs_cos, start)
    if fused_rotary_reasons(query, key, freqs_cos, freqs_sin):
        return (rotate_interleaved_reference(query, freqs_cos, freqs_sin, rule, start),
                rotate_interleaved_reference(key, freqs_cos, freqs_sin, rule, start))
    with torch.cuda.device(query.device):
        return _launch(query, key, freqs_cos, freqs_sin, rule, start)


def _launch(query: torch.Tensor, key: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor,
            rule: str, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's launch, inputs as ``fused_rotary_reasons`` accepts them (the interpreter's tests call it)."""
    batch, tokens, _, dim = query.shape
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if tokens == 0:
        return q_out, k_out

    def batch_stride(freqs: torch.Tensor) -> int:
        return freqs.stride(0) if freqs.shape[0] > 1 else 0

    rotated = freqs_cos.shape[1]
    launch(
        _rotate_kernel, (cdiv(tokens, ROTARY_BLOCK_S), batch),
        query, key, q_out, k_out, freqs_cos, freqs_sin, tokens, start, rotated, query.shape[2], key.shape[2],
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        batch_stride(freqs_cos), freqs_cos.stride(1), batch_stride(freqs_sin), freqs_sin.stride(1),
        HALF=dim // 2, BLOCK_S=ROTARY_BLOCK_S, PAIR=rule != "element", COMPLEX=rule == "complex",
        WINDOW=rotated < tokens, num_warps=4,
        enable_fp_fusion=False,
    )
    return q_out, k_out


if triton is not None:

    @triton.jit
    def _rotate_heads(x, out, batch, tok, keep, turn, tokens, heads, s_b, s_s, s_h, cos_e, cos_o, sin_e, sin_o,
                      HALF: tl.constexpr, BLOCK_S: tl.constexpr, COMPLEX: tl.constexpr, WINDOW: tl.constexpr):
        """Every head of one tensor for this program's tokens; ``out`` is contiguous ``[B, S, heads, 2 * HALF]``
        (COMPLEX: torch's complex multiply on CUDA, with its two fused multiply-adds; WINDOW: tokens outside ``turn``
        copied as they are)."""
        col = tl.arange(0, 2 * HALF)
        h = 0
        while h < heads:  # not `for h in range(heads)`: Triton 3.6's interpreter cannot take a runtime bound there
            src = x + batch * s_b + tok[:, None] * s_s + h * s_h + col[None, :]
            both = tl.reshape(tl.load(src, mask=keep, other=0.0).to(tl.float32), (BLOCK_S, HALF, 2))
            first, second = tl.split(both)
            if COMPLEX:
                turned = tl.join(tl.fma(first, cos_e, -(second * sin_e)), tl.fma(first, sin_o, second * cos_o))
            else:
                turned = tl.join(first * cos_e - second * sin_e, first * sin_o + second * cos_o)
            if WINDOW:
                turned = tl.where(tl.reshape(turn, (BLOCK_S, 1, 1)), turned, both)
            dst = out + ((batch * tokens + tok[:, None]) * heads + h) * (2 * HALF) + col[None, :]
            tl.store(dst, tl.reshape(turned, (BLOCK_S, 2 * HALF)).to(out.dtype.element_ty), mask=keep)
            h += 1

    @triton.jit
    def _rotate_kernel(q, k, q_out, k_out, freqs_cos, freqs_sin, tokens, start, rotated, q_heads, k_heads,
                       q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, fc_sb, fc_ss, fs_sb, fs_ss,
                       HALF: tl.constexpr, BLOCK_S: tl.constexpr, PAIR: tl.constexpr, COMPLEX: tl.constexpr,
                       WINDOW: tl.constexpr):
        """Program (token block, batch row): the angles of its tokens read once, then every head of Q and K. The
        tables hold ``rotated`` tokens from token ``start`` (all ``tokens`` from 0 unless WINDOW)."""
        batch = tl.program_id(1)
        tok = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
        pair = tl.arange(0, HALF)
        keep = tok[:, None] < tokens
        if WINDOW:
            row = tok - start
            turn = (row[:, None] >= 0) & (row[:, None] < rotated)
        else:
            row = tok
            turn = keep
        cos = freqs_cos + batch * fc_sb + row[:, None] * fc_ss + 2 * pair[None, :]
        sin = freqs_sin + batch * fs_sb + row[:, None] * fs_ss + 2 * pair[None, :]
        cos_e = tl.load(cos, mask=turn, other=0.0)
        sin_o = tl.load(sin + 1, mask=turn, other=0.0)
        if PAIR:  # Wan's and Qwen-Image's: one cosine (even entry) and one sine (odd entry) per pair
            cos_o = cos_e
            sin_e = sin_o
        else:
            cos_o = tl.load(cos + 1, mask=turn, other=0.0)
            sin_e = tl.load(sin, mask=turn, other=0.0)
        _rotate_heads(q, q_out, batch, tok, keep, turn, tokens, q_heads, q_sb, q_ss, q_sh, cos_e, cos_o, sin_e, sin_o,
                      HALF, BLOCK_S, COMPLEX, WINDOW)
        _rotate_heads(k, k_out, batch, tok, keep, turn, tokens, k_heads, k_sb, k_ss, k_sh, cos_e, cos_o, sin_e, sin_o,
                      HALF, BLOCK_S, COMPLEX, WINDOW)
