"""Padding masks: Qwen-Image's text padding in the middle of [text | image], LTX's additive mask."""

from __future__ import annotations

import pytest
import torch

import tiny_models
from diffusers_trtllm import TrtllmAttnProcessor
from diffusers_trtllm.serving import layer as layer_module
from diffusers_trtllm.layout import MaskNotSupportedError


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
    original = layer_module.build_layout
    monkeypatch.setattr(layer_module, "build_layout", lambda *a, **k: builds.append(1) or original(*a, **k))
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


def test_ltx_row_with_all_zero_text_mask_matches_stock():
    """Issue 13: an empty prompt row (-10000 on every text key) shifts all scores alike; stock attends to all keys."""
    model, inputs = tiny_models.build("ltx", batch=2)
    inputs["encoder_attention_mask"][1] = 0
    stock = _run(model, inputs)
    assert torch.isfinite(stock).all()
    for backend in ("auto", "reference"):
        proc = TrtllmAttnProcessor(backend=backend)
        model.set_attn_processor(proc)
        torch.testing.assert_close(_run(model, inputs), stock, rtol=1e-4, atol=1e-4)
        cross = [r for s in proc.layers if s.role == "cross" for r in s.records]
        expected = "sdpa" if backend == "auto" else backend  # our kernel path, not the stock fallback
        assert cross and all(r.route == expected for r in cross)


def test_bool_row_without_keys_gives_zero_rows_like_sdpa():
    from diffusers_trtllm import attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 2, 16, generator=gen) for _ in range(3))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1] = False
    stock = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :]).transpose(1, 2)
    for backend in ("sdpa", "reference"):
        torch.testing.assert_close(attention(q, k, v, attn_mask=mask, backend=backend), stock, rtol=1e-5, atol=1e-5)
    additive = torch.zeros(2, 1, 1, 6)
    additive[1] = float("-inf")
    torch.testing.assert_close(attention(q, k, v, attn_mask=additive, backend="reference"), stock, rtol=1e-5, atol=1e-5)


def test_ambiguous_2d_mask_is_refused():
    """Issue 13: a 2-D [L, L] mask with batch == L could be key padding or SDPA's [q_len, kv_len]."""
    import pytest

    from diffusers_trtllm import attention
    from diffusers_trtllm.layout import MaskNotSupportedError

    q = torch.randn(4, 4, 2, 16)
    mask = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(MaskNotSupportedError, match=r"ambiguous.*\[batch, 1, 1, kv_len\]"):
        attention(q, q, q, attn_mask=mask)
    same_rows = torch.tensor([[True, True, True, False]]).expand(4, 4)  # both readings agree
    expected = attention(q, q, q, attn_mask=same_rows[:1].expand(4, 4)[:, None, None, :], backend="reference")
    torch.testing.assert_close(attention(q, q, q, attn_mask=same_rows, backend="reference"), expected)


def test_outer_product_mask_packs_keys_and_keeps_stock_rows_for_padded_queries():
    """Chroma's mask is (text padding | image) x itself: valid queries run on our kernel over the valid
    keys; padded queries (which attend to nothing) get exactly the stock kernel's rows."""
    import family_models

    model, inputs = family_models.build("ChromaTransformer")
    text = inputs["encoder_hidden_states"].shape[1]
    image = inputs["hidden_states"].shape[1]
    mask = torch.ones(1, text + image, dtype=torch.bool)
    mask[0, 5:text] = False  # text padding
    inputs["attention_mask"] = mask
    stock = _run(model, inputs)
    proc = TrtllmAttnProcessor()
    model.set_attn_processor(proc)
    torch.testing.assert_close(_run(model, inputs), stock, rtol=1e-5, atol=1e-5, equal_nan=True)
    routes = {r.route for s in proc.layers for r in s.records}
    assert routes == {"sdpa"}, routes  # served, not left on the stock path


def test_outer_product_mask_rows_match_masked_sdpa():
    from diffusers_trtllm.layout import query_key_masks

    q_mask = torch.tensor([[True, True, False, True]])
    kv_mask = torch.tensor([[True, False, True, True, True]])
    outer = q_mask[:, None, :, None] & kv_mask[:, None, None, :]
    got_q, got_kv = query_key_masks(outer, 1, 4, 5)
    assert torch.equal(got_q, q_mask) and torch.equal(got_kv, kv_mask)
    additive = torch.zeros(1, 1, 4, 5).masked_fill(~outer, float("-inf"))
    assert torch.equal(query_key_masks(additive, 1, 4, 5)[1], kv_mask)
    refiner = outer.clone()
    refiner[0, 0, 2, 0] = True  # HunyuanVideo's refiner: a padded query attends to the first key
    assert torch.equal(query_key_masks(refiner, 1, 4, 5)[0], q_mask)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    with pytest.raises(MaskNotSupportedError):
        query_key_masks(causal, 1, 4, 4)


def test_a_nan_in_a_masked_out_text_key_never_reaches_the_output():
    """Stock SDPA adds the mask to every score, so a NaN key it masks out still turns its rows NaN; ours packs the
    valid keys only, so a masked key is never read (docs/usage.md, "Masks"): the output is the one the same model
    gives with that padding token zeroed."""
    model, inputs = tiny_models.build("ltx")  # text tokens 4 and 5 are padding
    poisoned = dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"].clone())
    poisoned["encoder_hidden_states"][:, 5] = float("nan")
    zeroed = dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"].clone())
    zeroed["encoder_hidden_states"][:, 5] = 0.0
    assert torch.isnan(_run(model, poisoned)).all(), "stock turns the whole output NaN"
    stock_zeroed = _run(model, zeroed)
    model.set_attn_processor(TrtllmAttnProcessor(backend="reference"))
    out = _run(model, poisoned)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _run(model, zeroed))
    torch.testing.assert_close(out, stock_zeroed, rtol=1e-4, atol=1e-4)
