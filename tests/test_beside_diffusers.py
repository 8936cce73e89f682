"""The processor beside the rest of Diffusers (issue 33): PAG pipelines, layer-skip guidance, caches, a compiled
pipeline, IP-adapter loading, and stock models left exactly as they were."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

import family_models
import tiny_models
from diffusers_trtllm import TrtllmAttnProcessor, attach_denoise_tracking, install, uninstall
from diffusers_trtllm.serving import intercept
from diffusers_trtllm.serving.layer import layer_of

DENSE = dict(backend="reference")


def _seeded(**kwargs):
    """Pipeline arguments with a fresh seeded generator, so two runs start from the same latents."""
    return dict(kwargs, generator=torch.Generator().manual_seed(0))


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def _setters_wrapped() -> bool:
    from diffusers.models.attention import AttentionMixin, AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return any(hasattr(f, "__wrapped__") for f in (AttentionModuleMixin.set_processor, Attention.set_processor,
                                                    AttentionMixin.set_attn_processor))


# ---- 1. PAG pipelines swap processors in by attribute -----------------------------------------------
def _sd3_pag_pipeline():
    from diffusers import StableDiffusion3PAGPipeline

    pipe, kwargs = tiny_models.sd3_pipeline()
    components = {k: v for k, v in pipe.components.items() if k not in ("image_encoder", "feature_extractor")}
    pag = StableDiffusion3PAGPipeline(**components, pag_applied_layers=["blocks.0"])
    pag.set_progress_bar_config(disable=True)
    kwargs = dict(kwargs, guidance_scale=2.0, negative_prompt_embeds=torch.zeros_like(kwargs["prompt_embeds"]),
                  negative_pooled_prompt_embeds=torch.zeros_like(kwargs["pooled_prompt_embeds"]), num_inference_steps=2)
    return pag, kwargs


def test_a_pag_run_leaves_the_stock_processors_recorded():
    pipe, kwargs = _sd3_pag_pipeline()
    with torch.no_grad():
        stock_pag = pipe(**_seeded(**kwargs), pag_scale=3.0).images
        stock = pipe(**_seeded(**kwargs), pag_scale=0.0).images
    stock_types = {n: type(p) for n, p in pipe.transformer.attn_processors.items()}
    install(pipe, TrtllmAttnProcessor(**DENSE))
    with torch.no_grad():
        torch.testing.assert_close(pipe(**_seeded(**kwargs), pag_scale=3.0).images, stock_pag)  # PAG's layer runs PAG's processor
        torch.testing.assert_close(pipe(**_seeded(**kwargs), pag_scale=0.0).images, stock)  # the next run has its stock back
    uninstall(pipe)
    assert {n: type(p) for n, p in pipe.transformer.attn_processors.items()} == stock_types
    with torch.no_grad():
        assert torch.equal(pipe(**_seeded(**kwargs), pag_scale=0.0).images, stock)


# ---- 2. layer-skip guidance ---------------------------------------------------------------------------
def _skip_config(scores: bool):
    from diffusers import LayerSkipConfig

    return LayerSkipConfig(indices=[0], fqn="transformer_blocks", skip_attention=not scores,
                           skip_attention_scores=scores, skip_ff=False)


def _build(family):
    return family_models.build(family) if family[0].isupper() else tiny_models.build(family)


# Diffusers 0.42.1 skips layers only where its registry knows the stock processor and the attention module says
# whether it is cross-attention: Qwen-Image (dispatch_attention_fn) and PixArt (F.scaled_dot_product_attention).
@pytest.mark.parametrize("family,scores", [("qwenimage", True), ("PixArtTransformer2D", True),
                                           ("PixArtTransformer2D", False)])
@pytest.mark.parametrize("install_first", [True, False], ids=["install-first", "skip-first"])
def test_layer_skip_perturbs_the_served_model_as_stock(family, scores, install_first):
    from diffusers.hooks import apply_layer_skip

    stock, inputs = _build(family)
    plain = _run(stock, inputs)
    apply_layer_skip(stock, _skip_config(scores))
    expected = _run(stock, inputs)
    assert not torch.equal(expected, plain), "the perturbation must change the output for this test to mean anything"
    model, _ = _build(family)
    proc = TrtllmAttnProcessor(**DENSE)
    if install_first:
        install(model, proc)
        apply_layer_skip(model, _skip_config(scores))
    else:
        apply_layer_skip(model, _skip_config(scores))
        install(model, proc)
    torch.testing.assert_close(_run(model, inputs), expected)
    served = [s for s in proc.layers if s.records and s.records[-1].route != "stock"]
    assert served, "the layers layer-skip leaves alone stay on our kernels"


def _perturbed_pass(guider, model, inputs):
    """The guider's perturbed forward: its third ``prepare_models`` of a step (after the unconditional and the
    conditional ones) applies the layer-skip hooks."""
    guider.set_state(step=1, num_inference_steps=10, timestep=inputs["timestep"])
    for _ in range(3):
        guider.prepare_models(model)
    try:
        return _run(model, inputs)
    finally:
        guider.cleanup_models(model)


def test_perturbed_attention_guidance_guider_on_a_served_model():
    from diffusers import PerturbedAttentionGuidance

    guider = PerturbedAttentionGuidance(perturbed_guidance_layers=[0])
    stock, inputs = tiny_models.build("qwenimage")
    expected = _perturbed_pass(guider, stock, inputs)
    assert not torch.equal(expected, _run(stock, inputs))
    model, _ = tiny_models.build("qwenimage")
    install(model, TrtllmAttnProcessor(**DENSE))
    torch.testing.assert_close(_perturbed_pass(guider, model, inputs), expected)
    torch.testing.assert_close(_run(model, inputs), _run(stock, inputs))  # the hooks are gone again


# ---- 3. a compiled pipeline ---------------------------------------------------------------------------
def test_compiled_flux_pipeline_runs_with_fullgraph():
    pipe, kwargs = tiny_models.flux_pipeline()
    with torch.no_grad():
        expected = pipe(**_seeded(**kwargs), num_inference_steps=2).images
    install(pipe, TrtllmAttnProcessor(**DENSE))
    torch._dynamo.reset()
    pipe.transformer = torch.compile(pipe.transformer, fullgraph=True, backend="eager")
    with torch.no_grad():
        out = pipe(**_seeded(**kwargs), num_inference_steps=2).images
    torch.testing.assert_close(out, expected)


# ---- 4. caches that skip a step's attention -----------------------------------------------------------
def test_a_cache_that_skips_a_whole_step_keeps_the_step_numbers():
    from diffusers import PyramidAttentionBroadcastConfig

    pipe, kwargs = tiny_models.flux_pipeline()
    proc = TrtllmAttnProcessor(**DENSE)
    install(pipe, proc)
    attach_denoise_tracking(pipe)
    pipe.transformer.enable_cache(PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1001),
        current_timestep_callback=lambda: pipe.current_timestep))
    with torch.no_grad():
        pipe(**_seeded(**kwargs), num_inference_steps=4)
    timesteps = [round(float(t) / 1000, 4) for t in pipe.scheduler.timesteps]
    rows = proc.step_table()
    assert len(rows) < 4, "the cache must skip a step for this test to mean anything"
    assert {r["step"]: round(r["t"], 4) for r in rows} == {r["step"]: timesteps[r["step"]] for r in rows}


# ---- 5. IP-adapter loading and unloading rebuild processors by class -----------------------------------
def test_processors_rebuilt_by_class_keep_their_settings(caplog):
    pipe, kwargs = tiny_models.flux_pipeline()
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.3, backend="reference")
    install(pipe, proc)
    with torch.no_grad():
        expected = pipe(**_seeded(**kwargs), num_inference_steps=2).images
    with caplog.at_level(logging.INFO, logger="diffusers"):
        pipe.unload_ip_adapter()  # rebuilds every processor as type(proc)()
    assert {type(p) for p in pipe.transformer.attn_processors.values()} == {TrtllmAttnProcessor}
    assert {id(p) for p in pipe.transformer.attn_processors.values()} == {id(proc)}
    with torch.no_grad():
        torch.testing.assert_close(pipe(**_seeded(**kwargs), num_inference_steps=2).images, expected)


def test_one_default_processor_given_by_the_user_still_replaces_ours():
    model, inputs = tiny_models.build("flux")
    install(model, TrtllmAttnProcessor(skip_softmax_threshold=0.3, backend="reference"))
    dense = TrtllmAttnProcessor()
    model.set_attn_processor(dense)
    assert {id(p) for p in model.attn_processors.values()} == {id(dense)}


# ---- 6. stock models exactly as they were -------------------------------------------------------------
def test_stock_models_are_bit_identical_and_diffusers_restored_after_the_last_uninstall(tmp_path):
    from diffusers import FluxTransformer2DModel
    from diffusers.models import attention_dispatch

    model, inputs = tiny_models.build("flux")
    model.save_pretrained(tmp_path)
    before = _run(model, inputs)
    reloaded_before = _run(FluxTransformer2DModel.from_pretrained(tmp_path).eval(), inputs)
    gc.collect()
    assert not intercept.live_layers()
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.3, backend="reference")
    install(model, proc)
    assert not torch.equal(_run(model, inputs), before)
    uninstall(model)
    # The processor lives on, but nothing of ours is installed: Diffusers is as it was.
    assert not _setters_wrapped(), "Diffusers' setters must be its own once nothing of ours is installed"
    module = __import__("sys").modules["diffusers.models.transformers.transformer_flux"]
    assert module.dispatch_attention_fn is attention_dispatch.dispatch_attention_fn
    assert torch.equal(_run(model, inputs), before)
    assert torch.equal(_run(FluxTransformer2DModel.from_pretrained(tmp_path).eval(), inputs), reloaded_before)
    # The documented idiom still serves the model, and uninstalling again restores it bit for bit.
    model.set_attn_processor(proc)
    assert not torch.equal(_run(model, inputs), before)
    assert all(layer_of(m) is not None for m in model.modules() if hasattr(m, "processor"))
    uninstall(model)
    assert torch.equal(_run(model, inputs), before) and not _setters_wrapped()
