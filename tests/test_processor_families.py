"""TrtllmAttnProcessor on a tiny model of every family: dense equals stock, skip/SAGE stay close."""

from __future__ import annotations

import logging

import pytest
import torch

import tiny_models
from conftest import rel_l1
from diffusers_trtllm import TrtllmAttnProcessor
from diffusers_trtllm.serving.layer import layer_of

#: (family, roles the layers must have, how each is served)
EXPECTED = {
    "flux": {("joint", "dispatch"), ("self", "dispatch")},
    "flux2": {("joint", "dispatch"), ("self", "dispatch")},
    "sd3": {("joint", "sdpa")},
    "sd35": {("joint", "sdpa"), ("self", "sdpa")},
    "wan_t2v": {("self", "dispatch"), ("cross", "dispatch")},
    "wan_i2v": {("self", "dispatch"), ("cross", "dispatch")},
    "qwenimage": {("joint", "dispatch")},
    "hunyuanvideo": {("refiner", "sdpa"), ("joint", "dispatch")},  # single blocks concatenate text: joint
    "ltx": {("self", "dispatch"), ("cross", "dispatch")},
    "cogvideox": {("joint", "sdpa")},
}


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_dense_equals_stock_and_sparse_stays_close(family):
    model, inputs = tiny_models.build(family)
    stock = _run(model, inputs)

    proc = TrtllmAttnProcessor()
    model.set_attn_processor(proc)
    dense = _run(model, inputs)
    torch.testing.assert_close(dense, stock, rtol=1e-5, atol=1e-5)
    assert {(s.role, s.mode) for s in proc.layers} == EXPECTED[family]
    assert all(s.records for s in proc.layers), "every layer must have run"
    routes = {r.route for s in proc.layers for r in s.records}
    assert routes <= {"sdpa", "stock"}

    sparse = TrtllmAttnProcessor(skip_softmax_threshold=0.3, quant={"dtype_qk": "int8", "k_block_size": 1},
                                 backend="reference", collect_stats=True)
    model.set_attn_processor(sparse)
    out = _run(model, inputs)
    assert torch.isfinite(out).all()
    assert 0.0 < rel_l1(out, stock) < 0.05
    served = [r for s in sparse.layers for r in s.records if r.route == "reference"]
    assert served and all(r.sage and r.total_tiles for r in served)


def test_dict_form_and_mixed_processors():
    model, inputs = tiny_models.build("flux")
    stock = _run(model, inputs)
    proc = TrtllmAttnProcessor()
    names = list(model.attn_processors)
    model.set_attn_processor({name: proc for name in names})
    torch.testing.assert_close(_run(model, inputs), stock, rtol=1e-5, atol=1e-5)
    assert sorted(s.name for s in proc.layers) == sorted(n.rsplit(".processor", 1)[0] for n in names)

    # Only the single-stream block on ours; the other keeps a stock processor.
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    model2, _ = tiny_models.build("flux")
    proc2 = TrtllmAttnProcessor()
    model2.set_attn_processor({n: (proc2 if n.startswith("single") else FluxAttnProcessor()) for n in names})
    torch.testing.assert_close(_run(model2, inputs), stock, rtol=1e-5, atol=1e-5)
    assert [s.name for s in proc2.layers] == ["single_transformer_blocks.0.attn"]


def test_role_overrides():
    model, inputs = tiny_models.build("wan_t2v")
    stock = _run(model, inputs)
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.3, backend="reference",
                               roles={"cross": "stock", "self": {"quant": {"dtype_qk": "int8", "k_block_size": 1}}})
    model.set_attn_processor(proc)
    out = _run(model, inputs)
    assert rel_l1(out, stock) < 0.05
    by_role = {s.role: s for s in proc.layers}
    assert not by_role["cross"].records  # "stock": the family's own attention, untouched
    assert all(r.sage for r in by_role["self"].records)

    dense_cross = TrtllmAttnProcessor(skip_softmax_threshold=0.3, backend="reference", roles={"cross": "dense"})
    model.set_attn_processor(dense_cross)
    _run(model, inputs)
    assert all(not r.sparse and not r.sage for s in dense_cross.layers if s.role == "cross" for r in s.records)

    with pytest.raises(ValueError, match="unknown roles"):
        TrtllmAttnProcessor(roles={"text": "dense"})
    with pytest.raises(ValueError, match="unknown keys"):
        TrtllmAttnProcessor(roles={"cross": {"threshold": 0.1}})
    with pytest.raises(ValueError, match="quant.dtype_qk"):
        TrtllmAttnProcessor(quant={"dtype_qk": "bf16"})


def test_wan22_two_experts_share_one_processor():
    pipe, kwargs = tiny_models.wan_pipeline(two_experts=True)
    proc = TrtllmAttnProcessor()
    pipe.transformer.set_attn_processor(proc)
    pipe.transformer_2.set_attn_processor(proc)
    assert len(proc.layers) == 8  # 2 blocks x (attn1, attn2) x 2 experts
    assert layer_of(pipe.transformer.blocks[0].attn1) is not layer_of(pipe.transformer_2.blocks[0].attn1)
    out = pipe(**kwargs, num_inference_steps=2).frames
    assert torch.isfinite(out).all()


def test_unservable_layer_keeps_stock_behaviour(caplog):
    """A processor that calls neither dispatch_attention_fn nor F.sdpa keeps running as is."""
    from diffusers.models.attention_processor import Attention, AttnProcessor

    attn = Attention(query_dim=16, heads=2, dim_head=8, processor=AttnProcessor()).eval()
    x = torch.randn(1, 10, 16)
    with torch.no_grad():
        ref = attn(x)
        attn.set_processor(TrtllmAttnProcessor())
        with caplog.at_level(logging.WARNING, logger="diffusers_trtllm"):
            out = attn(x)
            attn(x)
    torch.testing.assert_close(out, ref)
    assert layer_of(attn).mode is None
    assert sum("keeps its stock attention" in r.message for r in caplog.records) <= 1


def test_refiner_mask_is_served_with_stock_rows_for_padded_queries():
    """HunyuanVideo's token refiner: text padding x text padding, padded queries attend to the first key.
    Valid queries run on our kernel; padded ones get the stock kernel's rows."""
    model, inputs = tiny_models.build("hunyuanvideo")
    stock = _run(model, inputs)
    proc = TrtllmAttnProcessor()
    model.set_attn_processor(proc)
    torch.testing.assert_close(_run(model, inputs), stock, rtol=1e-5, atol=1e-5)
    refiner = [s for s in proc.layers if s.role == "refiner"]
    assert refiner and all(r.route == "sdpa" for s in refiner for r in s.records)
