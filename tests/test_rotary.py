"""Wan's, Flux's, HunyuanVideo's, LTX-Video's, Qwen-Image's and CogVideoX's rotary embeddings applied by us at the attention call
(``serving.rotary``, ``kernels.rotary``): the same values as the families' own processors, on the CPU through the
torch form and in Triton's interpreter through the kernel; the layers where it must not happen keep their own
rotation."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tiny_models
from triton_support import compiled_for, fma_missing, interpreted
from conftest import requires_cuda
from diffusers_trtllm import TrtllmAttnProcessor
from diffusers_trtllm.kernels import rotary
from diffusers_trtllm.serving import rotary as serving_rotary
from diffusers_trtllm.serving.layer import layer_of


def wan_rotation(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's processor's rotation, op for op (diffusers' transformer_wan, ``apply_rotary_emb``)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def frequencies(batch: int, tokens: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    angle = torch.randn(batch, tokens, 1, dim // 2, generator=torch.Generator().manual_seed(seed)) * 8
    return angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1)


def flux_rotation(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Flux's processor's rotation: Diffusers' ``apply_rotary_emb`` on ``[S, D]`` tables, ``sequence_dim=1``."""
    from diffusers.models.embeddings import apply_rotary_emb

    return apply_rotary_emb(x, (freqs_cos[0, :, 0], freqs_sin[0, :, 0]), sequence_dim=1)


def qwen_rotation(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Qwen-Image's processor's rotation: ``apply_rotary_emb_qwen(x, freqs_cis, use_real=False)`` with the complex
    ``[S, D / 2]`` table ``cos + i sin`` (the pair rule's entries)."""
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    return apply_rotary_emb_qwen(x, torch.complex(freqs_cos[0, :, 0, 0::2], freqs_sin[0, :, 0, 1::2]), use_real=False)


STOCK = {"pair": wan_rotation, "element": flux_rotation, "complex": qwen_rotation}


@pytest.mark.parametrize("rule", rotary.RULES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_torch_form_is_the_familys_bit_for_bit(dtype, rule):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 19, 3, 16, generator=g) * 4).to(dtype)
    for cos, sin in (frequencies(1, 19, 16), (torch.randn(1, 19, 1, 16, generator=g), torch.randn(1, 19, 1, 16, generator=g))):
        assert torch.equal(rotary.rotate_interleaved_reference(x, cos, sin, rule), STOCK[rule](x, cos, sin))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shorter_tables_turn_the_leading_tokens_as_hunyuanvideo_does(dtype):
    """HunyuanVideo's processors rotate the video tokens (``apply_rotary_emb`` on ``x[:, :-text]``) and append the
    text's unturned: tables of fewer tokens than Q give the same, by the torch form and (on the CPU) ours."""
    from diffusers.models.embeddings import apply_rotary_emb

    g = torch.Generator().manual_seed(2)
    q, k = ((torch.randn(2, 23, 3, 16, generator=g) * 4).to(dtype) for _ in range(2))
    cos, sin = torch.randn(17, 16, generator=g), torch.randn(17, 16, generator=g)
    want = [torch.cat([apply_rotary_emb(x[:, :17], (cos, sin), sequence_dim=1), x[:, 17:]], dim=1) for x in (q, k)]
    got = rotary.rotate_interleaved(q, k, cos[None, :, None], sin[None, :, None], rule="element")
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 40), rotated=st.integers(1, 40), start=st.integers(-3, 40), rule=st.sampled_from(rotary.RULES))
def test_window_from_start_turns_those_tokens_and_keeps_the_rest(tokens, rotated, start, rule):
    """Tables of ``R`` tokens from ``start`` turn exactly that window, as the family turns it alone (CogVideoX's
    processor: ``apply_rotary_emb`` on ``x[:, text:]``), and keep every other token; a window that does not fit in Q
    is refused by name, by the torch form called alone too."""
    g = torch.Generator().manual_seed(tokens * 41 + rotated)
    q, k = ((torch.randn(2, tokens, 3, 16, generator=g) * 4).bfloat16() for _ in range(2))
    cos, sin = (torch.randn(1, rotated, 1, 16, generator=g) for _ in range(2))
    if start < 0 or start + rotated > tokens:
        for rotate in (lambda: rotary.rotate_interleaved(q, k, cos, sin, rule=rule, start=start),
                       lambda: rotary.rotate_interleaved_reference(q, cos, sin, rule=rule, start=start)):
            with pytest.raises(ValueError, match=rf"start {start}: .* \(0 <= start <= S - R\)"):
                rotate()
        return
    got = rotary.rotate_interleaved(q, k, cos, sin, rule=rule, start=start)
    assert torch.equal(got[0], rotary.rotate_interleaved_reference(q, cos, sin, rule=rule, start=start))
    end = start + rotated
    for x, out in zip((q, k), got):
        assert torch.equal(out[:, start:end], STOCK[rule](x[:, start:end], cos, sin))
        assert torch.equal(out[:, :start], x[:, :start]) and torch.equal(out[:, end:], x[:, end:])


def test_unknown_rule_is_named():
    x = torch.zeros(1, 2, 1, 4)
    with pytest.raises(ValueError, match="rule must be one of"):
        rotary.rotate_interleaved(x, x, x, x, rule="halves")


def test_kernel_reasons_name_what_is_wrong():
    x = torch.zeros(1, 4, 2, 12)
    cos, sin = frequencies(1, 4, 12)
    reasons = rotary.fused_rotary_reasons(x, x, cos, sin)
    assert any("CUDA" in r for r in reasons) and any("power of two" in r for r in reasons)
    assert any("[1 or 1, at most 4, 1, 8]" in r for r in rotary.fused_rotary_reasons(x[..., :8], x[..., :8], cos, sin))
    # Off the kernel's layout, the torch form answers: the same values.
    q, k = rotary.rotate_interleaved(x + 1, x - 1, cos, sin)
    assert torch.equal(q, wan_rotation(x + 1, cos, sin)) and torch.equal(k, wan_rotation(x - 1, cos, sin))


# ---- the kernel under Triton's interpreter (a child process: TRITON_INTERPRET is read at import) ---------------
_CHILD = r"""
import json, torch
from diffusers_trtllm.kernels import rotary
cases = []

# torch's complex multiply as it runs on CUDA (two fused multiply-adds: a * c - b * d as fma(a, c, -(b * d)),
# a * d + b * c as fma(a, d, b * c)), emulated in float64: a float32 product is exact there, so each fma rounds once
# but where float64's own rounding of the sum lands on a float32 tie, which these seeds do not meet.
def cuda_complex(x, cos, sin, start):
    end = start + cos.shape[1]
    a, b = x[:, start:end].double().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2].double(), sin[..., 1::2].double()
    re = (a * c - (b * s).float().double()).float()
    im = (a * s + (b * c).float().double()).float()
    return torch.cat((x[:, :start].float(), torch.stack((re, im), -1).flatten(-2), x[:, end:].float()), dim=1)

for rule, dtype in ((r, d) for r in rotary.RULES for d in (torch.bfloat16, torch.float16, torch.float32)):
    for batch, tokens, heads, k_heads, dim, freq_batch, rows, start, heads_first in (
            (1, 37, 3, 3, 16, 1, 37, 0, False), (2, 20, 2, 1, 8, 2, 20, 0, False), (2, 5, 1, 2, 4, 1, 5, 0, False),
            (2, 37, 2, 2, 8, 1, 21, 0, False), (2, 37, 2, 2, 8, 1, 21, 16, True), (2, 37, 2, 1, 8, 2, 19, 9, False),
            (2, 19, 3, 3, 8, 1, 19, 0, True)):
        g = torch.Generator().manual_seed(tokens)
        wide = (torch.randn(batch, tokens, heads * dim + 5, generator=g) * 4).to(dtype)
        q = wide[..., : heads * dim].unflatten(-1, (heads, dim))  # tokens strided, as a projection's view
        k = (torch.randn(batch, tokens, k_heads, dim, generator=g) * 4).to(dtype)
        if heads_first:  # [B, H, S, D] seen as [B, S, H, D], past 3 leading tokens (CogVideoX's video after its text)
            q, k = ((torch.randn(batch, h, 3 + tokens, dim, generator=g) * 4).to(dtype)[:, :, 3:].transpose(1, 2)
                    for h in (heads, k_heads))
        # Tables whose even and odd entries differ, so that reading the wrong one shows.
        cos, sin = (torch.randn(freq_batch, rows, 1, dim, generator=g) for _ in range(2))  # rows < tokens: a window
        got = rotary._launch(q, k, cos, sin, rule, start)
        ok = []
        for x, out in zip((q, k), got):
            exact = (cuda_complex(x.float(), cos, sin, start) if rule == "complex"
                     else rotary.rotate_interleaved_reference(x.float(), cos, sin, rule, start))
            # The interpreter casts float32 to bfloat16 by truncation (the GPU rounds to nearest even, as torch):
            # there the kernel's float32 values are checked through that cast.
            want = ((exact.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype) if dtype == torch.bfloat16
                    else exact.to(dtype))
            ok.append(bool(torch.equal(out, want)) and out.is_contiguous())
        cases.append({"case": f"{rule} {dtype} {tuple(q.shape)} k{tuple(k.shape)} freqs {tuple(cos.shape)} from {start}",
                      "ok": all(ok)})
print(json.dumps(cases))
"""


@pytest.fixture(scope="module")
def interpreted_rotations():
    return interpreted(_CHILD, count=63)


@pytest.mark.parametrize("rule", rotary.RULES)
def test_kernel_under_interpreter_gives_the_torch_values(interpreted_rotations, rule):
    if rule == "complex" and fma_missing():  # its cases are torch's fma rounding, which such an interpreter lacks
        pytest.skip(fma_missing())
    cases = [c for c in interpreted_rotations if c["case"].startswith(f"{rule} ")]
    assert cases and all(c["ok"] for c in cases), cases


# ---- at the attention call ---------------------------------------------------------------------------------
def _count_rotations(monkeypatch) -> list[tuple[int, ...]]:
    seen: list[tuple[int, ...]] = []

    def counting(rotate):
        def rotate_and_count(query, key, embedding):
            seen.append(tuple(query.shape))
            return rotate(query, key, embedding)
        return rotate_and_count

    for name, entry in list(serving_rotary.DEFERRED.items()):
        monkeypatch.setitem(serving_rotary.DEFERRED, name, serving_rotary.DeferredRotary(
            entry.argument, counting(entry.rotate), entry.serves))
    return seen


@pytest.mark.parametrize("family", ["wan_t2v", "wan_i2v"])
def test_wan_forward_is_stocks_bit_for_bit_with_our_rotation(family, monkeypatch):
    seen = _count_rotations(monkeypatch)
    model, ours, stock = tiny_models.served_and_stock(family, TrtllmAttnProcessor())
    assert torch.equal(ours, stock)
    deferred = [m for m in model.modules() if layer_of(m) is not None and layer_of(m).rotary is not None]
    # Self-attention (attn1) of each block; I2V's cross-attention has image projections and no rotary argument.
    assert {type(m).__name__ for m in deferred} == {"WanAttention"} and len(deferred) == 2 * len(model.blocks)
    assert len(seen) == len(model.blocks)  # one rotation per self-attention call, none for cross-attention


@pytest.mark.parametrize("family", ["flux", "flux2"])
def test_flux_forward_is_stocks_bit_for_bit_with_our_rotation(family, monkeypatch):
    seen = _count_rotations(monkeypatch)
    model, ours, stock = tiny_models.served_and_stock(family, TrtllmAttnProcessor())
    assert torch.equal(ours, stock)
    attention = [m for m in model.modules() if layer_of(m) is not None]
    assert attention and all(layer_of(m).rotary is not None for m in attention)
    assert len(seen) == len(attention)  # every block's one attention call, double and single stream


#: Families whose one attention call a block turns part of a joint Q and K: the tokens of each call.
JOINT_TOKENS = {
    "hunyuanvideo": 16 + 6,  # its 16 video tokens turned, the 6 text tokens after them kept (double and single blocks)
    "qwenimage": 8 + 16,  # its 8 text tokens, then its 16 image tokens, each by their own tables
    "cogvideox": 16 + 48,  # its 48 video tokens after 16 text tokens kept (through F.scaled_dot_product_attention)
}


@pytest.mark.parametrize("family", sorted(JOINT_TOKENS))
def test_joint_forward_is_stocks_bit_for_bit_with_our_rotation(family, monkeypatch):
    seen = _count_rotations(monkeypatch)
    model, ours, stock = tiny_models.served_and_stock(family, TrtllmAttnProcessor())
    assert torch.equal(ours, stock)
    blocks = len(model.transformer_blocks) + len(getattr(model, "single_transformer_blocks", ()))
    assert len(seen) == blocks and all(shape[1] == JOINT_TOKENS[family] for shape in seen)


def test_ltx_forward_is_stocks_bit_for_bit_with_our_rotation(monkeypatch):
    seen = _count_rotations(monkeypatch)
    model, ours, stock = tiny_models.served_and_stock("ltx", TrtllmAttnProcessor())
    assert torch.equal(ours, stock)
    assert len(seen) == len(model.transformer_blocks)  # self-attention; cross-attention gets no rotary argument


@pytest.mark.parametrize("family", ["wan_t2v", "flux", "flux2", "hunyuanvideo", "qwenimage", "cogvideox", "ltx"])
def test_fused_rotary_off_keeps_the_familys_own_rotation(family, monkeypatch):
    """``fused_rotary=False``: no rotation of ours; the family's processors turn Q and K, and the output is stock's."""
    seen = _count_rotations(monkeypatch)
    model, ours, stock = tiny_models.served_and_stock(family, TrtllmAttnProcessor(fused_rotary=False))
    assert torch.equal(ours, stock)
    assert not seen and all(layer_of(m).rotary is None for m in model.modules() if layer_of(m) is not None)


def test_qwenimage_tables_of_another_length_are_refused():
    table = torch.polar(torch.ones(5, 8), torch.randn(5, 8))
    q = torch.zeros(1, 9, 2, 16)
    entry = serving_rotary.DEFERRED["diffusers.models.transformers.transformer_qwenimage.QwenDoubleStreamAttnProcessor2_0"]
    with pytest.raises(ValueError, match="cover 5 text and 5 image tokens, but the joint Q holds 9"):
        entry.rotate(q, q, (table, table))


def test_trailing_tables_longer_than_q_are_refused():
    cos_sin = (torch.ones(9, 16), torch.zeros(9, 16))
    q = torch.zeros(1, 8, 2, 16)
    entry = serving_rotary.DEFERRED["diffusers.models.attention_processor.CogVideoXAttnProcessor2_0"]
    with pytest.raises(ValueError, match="cover 9 video tokens, more than the joint Q's 8"):
        entry.rotate(q, q, cos_sin)


def test_cogvideox_cross_attention_keeps_its_own_rotation():
    """Its processor turns a cross-attention's Q but not its K: such a module keeps the processor's rotation."""
    entry = serving_rotary.DEFERRED["diffusers.models.attention_processor.CogVideoXAttnProcessor2_0"]
    cross, plain = torch.nn.Module(), torch.nn.Module()
    cross.is_cross_attention = True
    cos_sin = (torch.ones(1), torch.zeros(1))
    assert serving_rotary.take_rotary(entry, cross, (), {"image_rotary_emb": cos_sin}) == (
        (), {"image_rotary_emb": cos_sin}, None)
    assert serving_rotary.take_rotary(entry, plain, (), {"image_rotary_emb": cos_sin})[2] is not None


def test_image_projections_keep_their_own_rotation():
    entry = serving_rotary.deferred_rotary(_wan_processor(), _parameters(_wan_processor()))
    assert entry is not None and entry.index == 3  # (hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
    assert pickle.loads(pickle.dumps(entry)) == entry  # pickled with a model's layer states: no lambda held

    class WithImage(torch.nn.Module):
        add_k_proj = torch.nn.Linear(2, 2)

    cos_sin = (torch.ones(1), torch.zeros(1))
    args = ("h", None, None, cos_sin)
    assert serving_rotary.take_rotary(entry, WithImage(), args, {}) == (args, {}, None)
    plain = torch.nn.Module()
    taken_args, taken_kwargs, turn = serving_rotary.take_rotary(entry, plain, args, {})
    assert taken_args == ("h", None, None, None) and turn is not None
    _, kwargs, turn = serving_rotary.take_rotary(entry, plain, ("h",), {"rotary_emb": cos_sin})
    assert kwargs == {"rotary_emb": None} and turn is not None
    assert serving_rotary.take_rotary(entry, plain, ("h",), {})[2] is None  # no rotary passed: nothing to take


def test_subclasses_are_not_deferred():
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    class Custom(WanAttnProcessor):
        pass

    assert serving_rotary.deferred_rotary(Custom(), _parameters(Custom())) is None


def _parameters(processor) -> list[str]:
    import inspect

    return list(inspect.signature(type(processor).__call__).parameters)[2:]


def _wan_processor():
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    return WanAttnProcessor()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rule", rotary.RULES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_on_gpu_is_the_familys_bit_for_bit(dtype, rule):
    g = torch.Generator().manual_seed(0)
    wide = (torch.randn(2, 1000, 4 * 128 + 64, generator=g) * 4).to(dtype).cuda()
    q = wide[..., : 4 * 128].unflatten(-1, (4, 128))
    k = (torch.randn(2, 1000, 2, 128, generator=g) * 4).to(dtype).cuda()
    for cos, sin in (frequencies(1, 1000, 128), (torch.randn(1, 1000, 1, 128), torch.randn(1, 1000, 1, 128))):
        cos, sin = cos.cuda(), sin.cuda()
        assert rotary.fused_rotary_reasons(q, k, cos, sin) == []
        q_out, k_out = rotary.rotate_interleaved(q, k, cos, sin, rule)
        assert torch.equal(q_out, STOCK[rule](q, cos, sin)) and torch.equal(k_out, STOCK[rule](k, cos, sin))
        # Tables of the first 774 tokens (HunyuanVideo's video tokens before its text): those turned, the rest kept.
        q_out, k_out = rotary.rotate_interleaved(q, k, cos[:, :774], sin[:, :774], rule)
        for x, out in ((q, q_out), (k, k_out)):
            assert torch.equal(out[:, :774], STOCK[rule](x[:, :774], cos[:, :774], sin[:, :774]))
            assert torch.equal(out[:, 774:], x[:, 774:])


@pytest.mark.gpu
@requires_cuda
def test_cogvideox_turn_on_gpu_is_its_processors_bit_for_bit():
    """CogVideoX's layout on the kernel: ``[B, H, S, D]`` seen as ``[B, S, H, D]`` (tokens closer than heads), the
    video's tokens after 226 of text, as its processor turns them in place with ``apply_rotary_emb``."""
    from diffusers.models.embeddings import apply_rotary_emb

    g = torch.Generator().manual_seed(0)
    q, k = ((torch.randn(2, 48, 226 + 1350, 64, generator=g) * 4).bfloat16().cuda() for _ in range(2))
    cos, sin = (f[0, :, 0].cuda() for f in frequencies(1, 1350, 64))
    entry = serving_rotary.DEFERRED["diffusers.models.attention_processor.CogVideoXAttnProcessor2_0"]
    assert rotary.fused_rotary_reasons(q.transpose(1, 2)[:, 226:], k.transpose(1, 2)[:, 226:], cos[None, :, None],
                                       sin[None, :, None]) == []
    q_out, k_out = entry.rotate(q.transpose(1, 2), k.transpose(1, 2), (cos, sin))
    for x, out in ((q, q_out), (k, k_out)):
        want = x.clone()
        want[:, :, 226:] = apply_rotary_emb(x[:, :, 226:], (cos, sin))
        assert torch.equal(out.transpose(1, 2), want)


@pytest.mark.parametrize("name", sorted(serving_rotary.DEFERRED))
def test_every_listed_processor_exists_and_takes_the_argument(name):
    import importlib

    module, cls = name.rsplit(".", 1)
    processor = getattr(importlib.import_module(module), cls)()
    entry = serving_rotary.deferred_rotary(processor, _parameters(processor))
    assert entry is not None and _parameters(processor)[entry.index] == entry.argument


@pytest.mark.parametrize("rule, window", [("pair", False), ("element", False), ("element", True), ("complex", False)])
def test_kernel_compiles_for_hopper_without_fused_multiply_adds(rule, window):
    """Through Triton's whole GPU pipeline without a GPU, specialized as a Wan2.1-14B 480p launch (``window``: with
    tables of fewer tokens, after 226 others, as CogVideoX's): no FMA in the PTX (each product rounded on its own, as torch's launches
    round them: the bit-for-bit claim) but the complex rule's two a pair (torch's complex multiply on CUDA), and Q/K
    moved in 16-byte vectors."""
    pytest.importorskip("triton")
    import re

    bf16, f32 = torch.empty(16, dtype=torch.bfloat16), torch.empty(16, dtype=torch.float32)
    tokens, width = 32760, 40 * 128
    start, rotated = (226, tokens - 226) if window else (0, tokens)
    args = (bf16, bf16, bf16, bf16, f32, f32, tokens, start, rotated, 40, 40, tokens * 3 * width, 3 * width, 128, tokens * width,
            width, 128, 0, 128, 0, 128)  # Q a view into fused QKV projections, K contiguous, frequencies [1, R, 1, 128]
    constexprs = dict(HALF=64, BLOCK_S=rotary.ROTARY_BLOCK_S, PAIR=rule != "element", COMPLEX=rule == "complex",
                      WINDOW=window)
    compiled = compiled_for(rotary._rotate_kernel, args, constexprs, num_warps=4, enable_fp_fusion=False)
    ptx = compiled.asm["ptx"]
    fmas, products = (len(re.findall(rf"\b{op}\.rn\.f32", ptx)) for op in ("fma", "mul"))
    assert (fmas, products > 0) == ((products, True) if rule == "complex" else (0, True))
    assert set(re.findall(r"st\.global[.\w]*", ptx)) == {"st.global.v4.b32"}
    assert "ld.global.v4.b32" in ptx
