"""IP-Adapters with the processor, and the keywords a stock processor gets (issue 55).

IP-Adapter weights are made here (random, seeded, shaped as Diffusers' loaders read them) and loaded from a
local safetensors file or state dict: nothing is downloaded, and no image encoder is built (the image
embeddings are passed directly). Every case runs in both orders (install, then ``load_ip_adapter``; and
the other way) and compares with stock Diffusers on the same model with the same adapter.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from safetensors.torch import save_file

import family_models
import tiny_models
from diffusers_trtllm import TrtllmAttnProcessor, attach_denoise_tracking, install, uninstall
from diffusers_trtllm.serving import processor as processor_module
from diffusers_trtllm.serving.keywords import accepted_keywords, keyword_filter
from diffusers_trtllm.serving.layer import layer_of

DENSE = dict(backend="reference")
ORDERS = ("install_then_load", "load_then_install")
IMAGE_PROMPT = "IP-Adapter's image-prompt tokens"


def _weights(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.3


def _latents(pipe, kwargs, **extra) -> torch.Tensor:
    with torch.no_grad():
        return pipe(**kwargs, **extra, num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images


def _served_and_stock(proc: TrtllmAttnProcessor, layer_name: str) -> tuple[set, set]:
    """The routes the layer's calls ran, and the notes of its stock calls."""
    rows = [r for r in proc.layer_step_rows() if r["layer"] == layer_name]
    return {route for r in rows for route in r["route"].split(",")}, {r["note"] for r in rows if r["note"]}


# ---- adapters made here, in the layouts Diffusers' loaders read ------------------------------------------------
def _image_projection(text_dim: int, embed_dim: int, tokens: int = 4) -> dict:
    """An IP-Adapter's image projection (``ImageProjection``: ``tokens`` text-width tokens from one image embedding)."""
    return {"proj.weight": _weights(tokens * text_dim, embed_dim, seed=1), "proj.bias": _weights(tokens * text_dim, seed=2),
            "norm.weight": torch.ones(text_dim), "norm.bias": torch.zeros(text_dim)}


def _flux_adapter(transformer, embed_dim: int = 16) -> dict:
    """For Flux and Chroma (FluxTransformer2DLoadersMixin): each double-stream block's image keys and values."""
    inner, text_dim = transformer.inner_dim, transformer.config.joint_attention_dim
    ip = {}
    for block in range(len(transformer.transformer_blocks)):
        for i, name in enumerate(("to_k_ip", "to_v_ip")):
            ip[f"{block}.{name}.weight"] = _weights(inner, text_dim, seed=10 + 4 * block + 2 * i)
            ip[f"{block}.{name}.bias"] = _weights(inner, seed=11 + 4 * block + 2 * i)
    return {"image_proj": _image_projection(text_dim, embed_dim), "ip_adapter": ip}


def _unet_adapter(unet, embed_dim: int = 12) -> dict:
    """For the UNet (UNet2DConditionLoadersMixin): every cross-attention's image keys and values, numbered as the
    original checkpoints number them (1, 3, 5, ...)."""
    text_dim = unet.config.cross_attention_dim
    ip, key_id = {}, 1
    for name in unet.attn_processors:
        if name.endswith("attn2.processor"):
            hidden = unet.get_submodule(name.rsplit(".", 1)[0]).to_q.out_features
            for i, kind in enumerate(("to_k_ip", "to_v_ip")):
                ip[f"{key_id}.{kind}.weight"] = _weights(hidden, text_dim, seed=50 + key_id + i)
            key_id += 2
    return {"image_proj": _image_projection(text_dim, embed_dim), "ip_adapter": ip}


def _sd3_adapter(transformer, embed_dim: int = 16) -> dict:
    """For SD3 (SD3Transformer2DLoadersMixin): the parameters of Diffusers' own classes, seeded: a time-aware image
    projection of one 64-wide head, and each block's IP-Adapter processor (its weights scaled up, so they show)."""
    from diffusers.models.attention_processor import SD3IPAdapterJointAttnProcessor2_0
    from diffusers.models.embeddings import IPAdapterTimeImageProjection

    inner, head_dim = transformer.inner_dim, transformer.config.attention_head_dim
    torch.manual_seed(60)
    projection = IPAdapterTimeImageProjection(embed_dim=embed_dim, output_dim=inner, hidden_dim=64, heads=1,
                                              num_queries=4, timestep_in_dim=32)
    ip = {}
    for block in range(len(transformer.transformer_blocks)):
        layer = SD3IPAdapterJointAttnProcessor2_0(hidden_size=inner, ip_hidden_states_dim=inner, head_dim=head_dim,
                                                  timesteps_emb_dim=64)
        ip.update({f"{block}.{k}": v * 3 for k, v in layer.state_dict().items()})
    return {"image_proj": projection.state_dict(), "ip_adapter": ip}


def _save(adapter: dict, folder) -> str:
    """``adapter`` as one safetensors file (``image_proj.*``, ``ip_adapter.*``), the layout the pipelines read."""
    save_file({f"{part}.{k}": v.contiguous() for part, tensors in adapter.items() for k, v in tensors.items()},
              folder / "ip_adapter.safetensors")
    return "ip_adapter.safetensors"


# ---- pipelines: load_ip_adapter, set_ip_adapter_scale, unload_ip_adapter --------------------------------------------
def _unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4,
                                out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
                                attention_head_dim=4, norm_num_groups=4).eval()


def _sd_pipeline():
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline

    vae = AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
                        latent_channels=4, norm_num_groups=1)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=_unet(),
                                   scheduler=DDIMScheduler(clip_sample=False), safety_checker=None,
                                   feature_extractor=None, image_encoder=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe, dict(prompt_embeds=_weights(1, 6, 16, seed=5), guidance_scale=1.0, height=8, width=8,
                      output_type="latent")


def _pipeline_case(family: str):
    """(pipeline, its arguments, the image prompt's arguments, the adapter, the loader's arguments, the adapter's
    processor class, one layer it takes, one it leaves to ours or None)."""
    from diffusers.models.attention_processor import IPAdapterAttnProcessor2_0, SD3IPAdapterJointAttnProcessor2_0
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    if family == "flux":
        pipe, kwargs = tiny_models.flux_pipeline()
        image = dict(ip_adapter_image_embeds=[_weights(1, 1, 16, seed=30)],
                     negative_ip_adapter_image_embeds=[torch.zeros(1, 1, 16)])
        return (pipe, kwargs, image, _flux_adapter(pipe.transformer),
                dict(image_encoder_pretrained_model_name_or_path=None), FluxIPAdapterAttnProcessor,
                "transformer_blocks.0.attn", "single_transformer_blocks.0.attn")
    if family == "sd3":
        pipe, kwargs = tiny_models.sd3_pipeline()
        return (pipe, kwargs, dict(ip_adapter_image_embeds=_weights(1, 3, 16, seed=61)), _sd3_adapter(pipe.transformer),
                dict(image_encoder_folder=None), SD3IPAdapterJointAttnProcessor2_0, "transformer_blocks.0.attn", None)
    pipe, kwargs = _sd_pipeline()
    return (pipe, kwargs, dict(ip_adapter_image_embeds=[_weights(1, 1, 12, seed=9)]), _unet_adapter(pipe.unet),
            dict(image_encoder_folder=None), IPAdapterAttnProcessor2_0,
            "down_blocks.0.attentions.0.transformer_blocks.0.attn2", "down_blocks.0.attentions.0.transformer_blocks.0.attn1")


def _denoiser(pipe):
    return getattr(pipe, "transformer", None) or pipe.unet


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("family", ["flux", "sd3", "sd"])
def test_pipelines_with_an_ip_adapter_equal_stock_and_serve_the_layers_own_attention(family, order, tmp_path):
    pipe, kwargs, image, adapter, load_kwargs, adapter_cls, adapter_layer, our_layer = _pipeline_case(family)
    weight_name = _save(adapter, tmp_path)
    model = _denoiser(pipe)

    def load():
        pipe.load_ip_adapter(tmp_path, subfolder="", weight_name=weight_name, **load_kwargs)

    without = _latents(pipe, kwargs)
    load()
    stock = _latents(pipe, kwargs, **image)
    stock_keys = set(model.state_dict())
    pipe.unload_ip_adapter()

    proc = TrtllmAttnProcessor(**DENSE)
    if order == "install_then_load":
        install(pipe, proc)
        load()
    else:
        load()
        install(pipe, proc)
    attach_denoise_tracking(pipe, proc)
    assert isinstance(model.get_submodule(adapter_layer).processor, adapter_cls)  # where Diffusers looks for it
    assert set(model.state_dict()) == stock_keys  # its weights where Diffusers keeps them
    ours = _latents(pipe, kwargs, **image)
    assert not torch.allclose(stock, without, atol=1e-3)
    torch.testing.assert_close(ours, stock)
    routes, notes = _served_and_stock(proc, adapter_layer)
    assert routes == {"reference", "stock"} and any(IMAGE_PROMPT in note for note in notes)
    if our_layer is not None:
        assert model.get_submodule(our_layer).processor is proc
        assert _served_and_stock(proc, our_layer) == ({"reference"}, set())

    pipe.set_ip_adapter_scale(0.0)  # Diffusers' own call reaches the adapter's processors
    torch.testing.assert_close(_latents(pipe, kwargs, **image), without)
    pipe.unload_ip_adapter()
    assert {id(p) for p in model.attn_processors.values()} == {id(proc)}
    torch.testing.assert_close(_latents(pipe, kwargs), without)


def test_uninstall_leaves_the_ip_adapter_loaded(tmp_path):
    pipe, kwargs, image, adapter, load_kwargs, adapter_cls, adapter_layer, _ = _pipeline_case("flux")
    pipe.load_ip_adapter(tmp_path, subfolder="", weight_name=_save(adapter, tmp_path), **load_kwargs)
    stock = _latents(pipe, kwargs, **image)
    install(pipe, TrtllmAttnProcessor(**DENSE))
    uninstall(pipe)
    layer = pipe.transformer.get_submodule(adapter_layer)
    assert isinstance(layer.processor, adapter_cls) and layer_of(layer) is None
    assert not layer._forward_pre_hooks and not layer._forward_hooks
    torch.testing.assert_close(_latents(pipe, kwargs, **image), stock)


def test_a_forward_that_raises_in_an_adapters_layer_leaves_no_layer_named(tmp_path):
    """Flux's adapter processor raises without an image prompt (stock too); the hooks put the thread's call back."""
    from diffusers_trtllm.serving import intercept

    pipe, kwargs, image, adapter, load_kwargs, *_ = _pipeline_case("flux")
    install(pipe, TrtllmAttnProcessor(**DENSE))
    pipe.load_ip_adapter(tmp_path, subfolder="", weight_name=_save(adapter, tmp_path), **load_kwargs)
    with pytest.raises(TypeError):
        _latents(pipe, kwargs)
    assert getattr(intercept._CALL, "layer", None) is None


# ---- Chroma (Flux's attention classes, no pipeline here): the model's own loader ---------------------------------
def _forward(model, inputs):
    with torch.no_grad():
        out = model(**{k: dict(v) if isinstance(v, dict) else v for k, v in inputs.items()})  # (the model pops keys)
    return family_models._first_tensor(out)


@pytest.mark.parametrize("order", ORDERS)
def test_chroma_with_an_ip_adapter_equals_stock(order):
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    stock_model, inputs = family_models.build("ChromaTransformer")
    adapter = _flux_adapter(stock_model)
    with_image = dict(inputs, joint_attention_kwargs={"ip_adapter_image_embeds": [_weights(1, 1, 16, seed=42)]})
    without = _forward(stock_model, inputs)
    stock_model._load_ip_adapter_weights([adapter])
    expected = _forward(stock_model, with_image)
    assert not torch.allclose(expected, without, atol=1e-4)

    model, _ = family_models.build("ChromaTransformer")
    proc = TrtllmAttnProcessor(**DENSE)
    if order == "install_then_load":
        install(model, proc)
        model._load_ip_adapter_weights([adapter])
    else:
        model._load_ip_adapter_weights([adapter])
        install(model, proc)
    assert isinstance(model.transformer_blocks[0].attn.processor, FluxIPAdapterAttnProcessor)
    torch.testing.assert_close(_forward(model, with_image), expected)
    routes, notes = _served_and_stock(proc, "transformer_blocks.0.attn")
    assert routes == {"reference", "stock"} and any(IMAGE_PROMPT in note for note in notes)


# ---- the keywords a stock processor gets: one family per keyword-filtering module ---------------------------------
#: One family whose model has each attention module that filters its processor's keywords (by its signature).
FILTERING_FAMILIES = (
    "FluxTransformer", "ChromaTransformer", "CogVideoXTransformer", "AceStepTransformer1DModel", "BriaTransformer",
    "BriaFiboTransformer", "ErnieImageTransformer", "Flux2Transformer", "Ideogram4Transformer",
    "JoyImageEditTransformer", "Kandinsky5Transformer", "Krea2Transformer", "LTX2Transformer", "LTXTransformer",
    "LongCatImageTransformer", "MotifVideoTransformer", "OvisImageTransformer",
)


def _first_call_of_each_filtering_module(model, inputs) -> dict[type, tuple]:
    """``{module class: (module, args, kwargs)}``: the first call, in a stock forward, of each attention module
    class that filters its processor's keywords and takes extra keywords."""
    import inspect

    calls: dict[type, tuple] = {}

    def record(module, args, kwargs):
        calls.setdefault(type(module), (module, args, dict(kwargs)))

    handles = []
    for module in model.modules():
        processor = getattr(module, "processor", None)
        takes_more = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(type(module).forward).parameters.values())
        if callable(processor) and takes_more and keyword_filter(type(module), type(processor)) is not None:
            handles.append(module.register_forward_pre_hook(record, with_kwargs=True))
    _forward(model, inputs)
    for handle in handles:
        handle.remove()
    return calls


def _outputs(out) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "not expected" in r.getMessage()]


@pytest.mark.parametrize("family", FILTERING_FAMILIES)
def test_a_keyword_the_stock_processor_does_not_take_is_dropped_as_stock_drops_it(family, caplog):
    model, inputs = family_models.build(family)
    calls = _first_call_of_each_filtering_module(model, inputs)
    assert calls, f"{family} has no keyword-filtering attention module"
    cases = []
    for module_cls, (module, args, kwargs) in calls.items():
        stock_cls = type(module.processor)
        rule = keyword_filter(module_cls, stock_cls)
        # A keyword ours names (so the module passes it on to ours) that the stock processor does not take.
        extra = sorted(processor_module._KEYWORDS - accepted_keywords(stock_cls) - rule.quiet - set(kwargs))
        extra = "temb" if "temb" in extra else extra[0]
        caplog.clear()
        with torch.no_grad():
            expected = _outputs(module(*args, **kwargs, **{extra: None}))
        cases.append((module, args, kwargs, extra, expected, _warnings(caplog)))

    install(model, TrtllmAttnProcessor(**DENSE))
    for module, args, kwargs, extra, expected, stock_warnings in cases:
        caplog.clear()
        with torch.no_grad():
            got = _outputs(module(*args, **kwargs, **{extra: None}))
        torch.testing.assert_close(got, expected)
        assert _warnings(caplog) == stock_warnings, (type(module).__name__, extra)


@pytest.mark.parametrize("family", ["FluxTransformer", "ChromaTransformer"])
def test_joint_attention_kwargs_no_processor_takes_are_dropped_with_a_warning(family, caplog):
    """A key no Diffusers processor takes: the module drops it before our processor sees it, with its warning (which
    names the processor it holds, ours); a key another processor takes (``temb``): dropped as stock drops it."""
    model, inputs = family_models.build(family)
    extra = {"not_a_processor_keyword": 1, "temb": None}
    stock_model, _ = family_models.build(family)
    caplog.clear()
    expected = _forward(stock_model, dict(inputs, joint_attention_kwargs=extra))
    stock_warnings = _warnings(caplog)
    assert any("'not_a_processor_keyword'" in w and "'temb'" in w for w in stock_warnings)
    install(model, TrtllmAttnProcessor(**DENSE))
    caplog.clear()
    torch.testing.assert_close(_forward(model, dict(inputs, joint_attention_kwargs=extra)), expected)
    assert _keys_warned_about(_warnings(caplog)) == _keys_warned_about(stock_warnings)


def _keys_warned_about(warnings: list[str]) -> list[str]:
    """The keys the warnings name, in order (a warning names a list of them)."""
    return sorted(key for w in warnings for key in re.findall(r"'([^']+)'", w.split("]")[0]))
