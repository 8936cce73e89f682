"""Diffusers' ``RMSNorm`` in one launch (``kernels.rms_norm``) and its takeover in our layers' stock processors
(``serving.qk_norm``): the torch form is Diffusers' forward exactly; the kernel, in Triton's interpreter and on the
GPU, gives its values but for the order of the sum of squares (an element one rounding apart, rarely); the takeover
happens only inside our layers and is undone with the other globals."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tiny_models
from conftest import requires_cuda
from triton_support import compiled_for, interpreted
from diffusers_trtllm import TrtllmAttnProcessor, install, uninstall
from diffusers_trtllm.kernels import rms_norm
from diffusers_trtllm.serving import intercept, qk_norm
from diffusers_trtllm.serving.layer import layer_of


def diffusers_norm(width: int, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.nn.Module:
    from diffusers.models.normalization import RMSNorm

    norm = RMSNorm(width, eps=eps, elementwise_affine=weight is not None)
    if weight is not None:
        norm.weight = torch.nn.Parameter(weight)
    return norm


def trained_like(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Q or K of a trained model: a per-channel mean and rows of magnitudes 1e-3 to 1e3."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(shape[-1], generator=g) * 3
    rows = 10.0 ** torch.randint(-3, 4, (*shape[:-1], 1), generator=g)
    return ((torch.randn(shape, generator=g) + mean) * rows).to(dtype)


# ---- the torch form ---------------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), width=st.sampled_from([16, 64, 128]),
       weight=st.sampled_from(["same", "none", "float32"]), rows=st.integers(1, 40), eps=st.sampled_from([1e-6, 1e-5]))
def test_torch_form_is_diffusers_forward_bit_for_bit(dtype, width, weight, rows, eps):
    x = trained_like((rows, 3, width), dtype, seed=rows)
    w = {"same": torch.randn(width).to(dtype), "none": None, "float32": torch.randn(width)}[weight]
    want = diffusers_norm(width, w, eps)(x)
    got = rms_norm.rms_norm(x, w, eps)  # the CPU: the torch form
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_reasons_say_what_the_kernel_does_not_take():
    x = torch.zeros(2, 4, 3, 128, dtype=torch.bfloat16)
    reasons = rms_norm.fused_rms_norm_reasons(x, torch.ones(128))
    assert any("CUDA" in r for r in reasons)
    assert any("weight must be a contiguous [128] of x's dtype torch.bfloat16" in r for r in reasons)
    assert any("x must be one of" in r for r in rms_norm.fused_rms_norm_reasons(x.float(), None))
    assert any("rows must be one of (32, 64, 128, 256) values wide; got shape (2, 4, 3, 96)" in r
               for r in rms_norm.fused_rms_norm_reasons(x[..., :96], None))
    assert any("densely" in r for r in rms_norm.fused_rms_norm_reasons(x[:, ::2], None))
    assert not any("densely" in r for r in rms_norm.fused_rms_norm_reasons(x.transpose(1, 2), None))
    strided = torch.ones(256, dtype=torch.bfloat16)[::2]
    assert any("must be a contiguous [128]" in r for r in rms_norm.fused_rms_norm_reasons(x, strided))
    assert any("must be a contiguous [128]" in r for r in rms_norm.fused_rms_norm_reasons(x, strided[:1].expand(128)))
    weight = torch.nn.Parameter(torch.ones(128, dtype=torch.bfloat16))
    assert any("no backward" in r for r in rms_norm.fused_rms_norm_reasons(x, weight))
    with torch.no_grad():
        assert not any("no backward" in r for r in rms_norm.fused_rms_norm_reasons(x, weight))


# ---- the kernel under Triton's interpreter (a child process: TRITON_INTERPRET is read at import) -----------------
_CHILD = r"""
import json, torch
from diffusers_trtllm.kernels import rms_norm
from test_rms_norm import trained_like

def cast(v, dtype):  # the interpreter casts float32 to bfloat16 by truncation (the GPU, as torch, to nearest even)
    return (v.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype) if dtype == torch.bfloat16 else v.to(dtype)

cases = []
for dtype in (torch.bfloat16, torch.float16):
    for width in (32, 64, 128):
        for heads_first in (False, True):
            x = trained_like((2, 37, 3, width), dtype, seed=width)
            if heads_first:  # SD3's [B, H, S, D] view of its [B, S, H, D] projection
                x = x.transpose(1, 2)
            w = torch.randn(width).to(dtype)
            normed, weighted = rms_norm.fused_rms_norm(x, None, 1e-6), rms_norm.fused_rms_norm(x, w, 1e-6)
            xf = x.float()
            want = cast(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6), dtype)
            steps = (normed.view(torch.int16).int() - want.view(torch.int16).int()).abs()
            cases.append({"case": f"{dtype} {tuple(x.shape)}", "apart": float((steps > 0).float().mean()),
                          "max_steps": int(steps.max()), "strides": normed.stride() == weighted.stride() == x.stride(),
                          "weight": bool(torch.equal(weighted, cast(normed.float() * w.float(), dtype)))})
print(json.dumps(cases))
"""


@pytest.fixture(scope="module")
def interpreted_norms():
    return interpreted(_CHILD, count=12)


def test_kernel_under_interpreter_gives_the_torch_values(interpreted_norms):
    """The normalized values at most one rounding from the torch form's, few of them (the sum's order); the weight's
    product on them rounded as torch rounds it; x's strides."""
    assert all(c["strides"] and c["weight"] and c["max_steps"] <= 1 and c["apart"] <= 0.02
               for c in interpreted_norms), interpreted_norms


def test_a_parameter_weight_is_launched_as_a_plain_tensor(monkeypatch):
    """``triton_launch.launch`` keeps compiled launchers for plain tensors only: a module's Parameter would take
    Triton's own path (tens of microseconds of host time) on every call."""
    seen = []
    monkeypatch.setattr(rms_norm, "launch", lambda kernel, grid, *args, **kwargs: seen.append(args))
    weight = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    with torch.no_grad():
        rms_norm.fused_rms_norm(torch.ones(3, 5, 64, dtype=torch.bfloat16), weight, 1e-6)
    assert [type(a) for a in seen[0][:3]] == [torch.Tensor] * 3


def test_kernel_compiles_for_hopper_moving_rows_in_16_byte_vectors():
    """Through Triton's whole GPU pipeline without a GPU, as a Qwen-Image 1024² launch: no fused multiply-add (each
    product rounded on its own, as torch's launches round them), one hardware reciprocal square root, rows moved in
    16-byte vectors."""
    pytest.importorskip("triton")
    import re

    bf16 = torch.empty(16, dtype=torch.bfloat16)
    compiled = compiled_for(rms_norm._rms_norm_kernel, (bf16, bf16, bf16, 4096 * 24, 1e-6),
                            dict(WIDTH=128, BLOCK_ROWS=32, HAS_WEIGHT=True), num_warps=4, enable_fp_fusion=False)
    ptx = compiled.asm["ptx"]
    assert "fma.rn.f32" not in ptx and re.search(r"rsqrt\.approx[.\w]*\.f32", ptx)
    assert set(re.findall(r"st\.global[.\w]*", ptx)) == {"st.global.v4.b32"} and "ld.global.v4.b32" in ptx


# ---- the takeover in our layers ---------------------------------------------------------------------------------
@pytest.fixture
def launches(monkeypatch):
    """Every takeover's launch, recorded: the kernel's reasons but autograd waived for the tiny models on the CPU
    (device, float32, 16-wide heads), its launch the torch form."""
    seen: list[tuple[int, ...]] = []
    reasons = rms_norm.fused_rms_norm_reasons

    def launch(x, weight, eps):
        seen.append(tuple(x.shape))
        return rms_norm.rms_norm_reference(x, weight, eps)

    monkeypatch.setattr(qk_norm, "fused_rms_norm_reasons",
                        lambda x, weight: [r for r in reasons(x, weight) if "no backward" in r])
    monkeypatch.setattr(qk_norm, "fused_rms_norm", launch)
    return seen


#: Diffusers ``RMSNorm`` calls one forward of each tiny model makes in its attention processors.
NORM_CALLS = {"qwenimage": 4 * 2, "sd35": 4 * 2 + 2 * 1, "hunyuanvideo": 4 * 1 + 2 * 1}


@pytest.mark.parametrize("family", sorted(NORM_CALLS))
def test_our_layers_take_the_norms_over_and_the_forward_stays_stocks(family, launches):
    _, ours, stock = tiny_models.served_and_stock(family, TrtllmAttnProcessor(fused_qk_norm=True))
    assert torch.equal(ours, stock)
    assert len(launches) == NORM_CALLS[family]
    assert qk_norm.RMS_NORM in intercept.rebound_modules()


def test_fused_qk_norm_off_stock_models_and_autograd_keep_diffusers_forward(launches):
    model, inputs = tiny_models.build("qwenimage")
    bystander, _ = tiny_models.build("qwenimage")
    install(model, TrtllmAttnProcessor(fused_qk_norm=True))
    model(**inputs)  # autograd on: the kernel has no backward
    assert not launches
    with torch.no_grad():
        install(model, TrtllmAttnProcessor())  # the default: Diffusers' norms
        model(**inputs)
        assert not launches and not any(layer_of(m).fused_qk_norm for m in model.modules() if layer_of(m))
        install(model, TrtllmAttnProcessor(fused_qk_norm=True))
        bystander(**inputs)  # a stock model beside ours: RMSNorm.forward is rebound, but no layer of ours runs
        assert not launches
        model(**inputs)
        assert len(launches) == NORM_CALLS["qwenimage"]


def _run_copies(model: torch.nn.Module, inputs: dict, launches: list) -> None:
    with torch.no_grad():
        for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            launches.clear()
            copied(**inputs)
            assert len(launches) == NORM_CALLS["qwenimage"]


def test_a_stock_role_keeps_diffusers_norms(launches):
    model, inputs = tiny_models.build("qwenimage")
    with torch.no_grad():
        install(model, TrtllmAttnProcessor(fused_qk_norm=True, roles={"joint": "stock", "self": "stock"}))
        model(**inputs)
    assert not launches


def test_copies_take_the_norms_over_and_uninstall_puts_diffusers_forward_back(launches):
    from diffusers.models.normalization import RMSNorm

    from diffusers_trtllm.serving.setters import restore_if_unused

    restore_if_unused()  # the earlier tests' models are gone
    original = RMSNorm.forward
    model, inputs = tiny_models.build("qwenimage")
    flux, _ = tiny_models.build("flux")
    install(flux, TrtllmAttnProcessor(fused_qk_norm=True))
    assert RMSNorm.forward is original, "Flux's QK norms are torch.nn.RMSNorm's: nothing to take over"
    install(model, TrtllmAttnProcessor(fused_qk_norm=True))
    _run_copies(model, inputs, launches)
    uninstall(model)
    uninstall(flux)
    assert RMSNorm.forward is original and intercept.rebound_modules() == []


def test_processor_says_when_the_norms_stay_diffusers():
    assert "fused_qk_norm=True" in repr(TrtllmAttnProcessor(fused_qk_norm=True))
    with pytest.raises(TypeError, match="fused_qk_norm must be True or False"):
        TrtllmAttnProcessor(fused_qk_norm="no")


# ---- on the GPU -------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape, heads_first", [
    ((1, 4096, 24, 128), False),  # Qwen-Image 1024²'s image Q
    ((2, 4429, 24, 64), True),  # SD3.5's [B, H, S, D] view, classifier-free guidance's batch of 2
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()  # as a pipeline runs: the kernel has no backward
def test_kernel_on_gpu_is_diffusers_but_for_rare_roundings(shape, heads_first, dtype):
    """Normalized values at most one rounding from Diffusers' (few: the order of the sum of squares), the weight's
    product on them as torch's, Diffusers' strides."""
    x = trained_like(shape, dtype).cuda()
    if heads_first:
        x = x.transpose(1, 2)
    weight = (torch.randn(shape[-1], generator=torch.Generator().manual_seed(1)) * 0.5 + 1).to(dtype).cuda()
    plain, weighted = diffusers_norm(shape[-1], None).cuda(), diffusers_norm(shape[-1], weight).cuda()
    assert rms_norm.fused_rms_norm_reasons(x, weighted.weight) == []
    normed = rms_norm.rms_norm(x, None, plain.eps)
    steps = (normed.view(torch.int16).int() - plain(x).view(torch.int16).int()).abs()
    apart = float((steps > 0).float().mean())
    print(f"{dtype} {tuple(x.shape)}: {apart:.2e} of the normalized elements one rounding apart")
    assert int(steps.max()) <= 1 and apart <= 1e-3
    got = rms_norm.rms_norm(x, weighted.weight, weighted.eps)
    assert torch.equal(got, normed * weighted.weight) and got.stride() == weighted(x).stride()


@pytest.mark.gpu
@requires_cuda
def test_served_qwenimage_forward_on_gpu_runs_the_kernel(monkeypatch):
    seen = []
    launch = qk_norm.fused_rms_norm

    def counting(x, weight, eps):
        seen.append(tuple(x.shape))
        return launch(x, weight, eps)

    monkeypatch.setattr(qk_norm, "fused_rms_norm", counting)
    from diffusers import QwenImageTransformer2DModel

    _, inputs = tiny_models.build("qwenimage")
    torch.manual_seed(0)
    # The tiny model's, with heads the kernel takes.
    model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                        attention_head_dim=64, num_attention_heads=2, joint_attention_dim=16,
                                        guidance_embeds=False, axes_dims_rope=(32, 16, 16))
    model = model.cuda().to(torch.bfloat16)
    inputs = {k: v.cuda().to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else
              v.cuda() if torch.is_tensor(v) else v for k, v in inputs.items()}
    with torch.no_grad():
        stock = model(**inputs)[0]
        install(model, TrtllmAttnProcessor(fused_qk_norm=True))
        ours = model(**inputs)[0]
    assert len(seen) == NORM_CALLS["qwenimage"]
    assert (ours.float() - stock.float()).abs().mean() / stock.float().abs().mean() < 0.02
