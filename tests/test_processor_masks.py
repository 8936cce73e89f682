"""Padding masks: Qwen-Image's text padding in the middle of [text | image], LTX's additive mask."""

from __future__ import annotations

import torch

import tiny_models
from diffusers_trtllm import TrtllmAttnProcessor
from diffusers_trtllm import processor as processor_module


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def test_qwenimage_padding_in_the_middle_matches_stock_masked_sdpa(monkeypatch):
    model, inputs = tiny_models.build("qwenimage", batch=2)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 2:5] = False  # holes inside the text, then the image tokens follow
    mask[1, 6:] = False
    inputs["encoder_hidden_states_mask"] = mask
    stock = _run(model, inputs)

    builds = []
    original = processor_module.build_layout
    monkeypatch.setattr(processor_module, "build_layout", lambda *a, **k: builds.append(1) or original(*a, **k))
    proc = TrtllmAttnProcessor()
    model.set_attn_processor(proc)
    out = _run(model, inputs)
    torch.testing.assert_close(out, stock, rtol=1e-5, atol=1e-5)
    assert len(builds) == 1, "one layout (one device sync) per transformer forward, shared by all layers"
    _run(model, inputs)
    assert len(builds) == 1, "the same mask object reuses its layout"

    ref = TrtllmAttnProcessor(backend="reference")
    model.set_attn_processor(ref)
    torch.testing.assert_close(_run(model, inputs), stock, rtol=1e-4, atol=1e-4)


def test_ltx_additive_cross_attention_mask_matches_stock():
    model, inputs = tiny_models.build("ltx", batch=2)
    inputs["encoder_attention_mask"][1, 2:] = 0
    stock = _run(model, inputs)
    proc = TrtllmAttnProcessor()
    model.set_attn_processor(proc)
    torch.testing.assert_close(_run(model, inputs), stock, rtol=1e-5, atol=1e-5)
    cross = [r for s in proc.layers if s.role == "cross" for r in s.records]
    assert cross and all(r.route == "sdpa" for r in cross)


def test_hunyuanvideo_key_padding_matches_stock():
    model, inputs = tiny_models.build("hunyuanvideo", batch=2)
    inputs["encoder_attention_mask"][0, 1:3] = 0
    stock = _run(model, inputs)
    model.set_attn_processor(TrtllmAttnProcessor(backend="reference"))
    torch.testing.assert_close(_run(model, inputs), stock, rtol=1e-4, atol=1e-4)


def test_ltx_bf16_additive_mask_is_a_padding_mask():
    """LTX builds ``(1 - mask) * -10000`` in the model dtype: -9984 in bf16 must still mean "masked"."""
    from diffusers_trtllm.layout import key_padding_mask

    mask = torch.tensor([[1, 1, 0]]).to(torch.bfloat16)
    additive = ((1 - mask) * -10000.0).unsqueeze(1)
    assert key_padding_mask(additive, 1, 4, 3).tolist() == [[True, True, False]]
