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


# ---- Flux: the pipeline's load_ip_adapter, set_ip_adapter_scale and unload_ip_adapter --------------------------
def _flux_adapter_file(transformer, folder, embed_dim: int = 16, tokens: int = 4) -> str:
    """An IP-Adapter for ``transformer`` in the file layout FluxIPAdapterMixin reads: the image projection
    (``image_proj.*``) and each double-stream block's image keys and values (``ip_adapter.<block>.*``)."""
    inner, text_dim = transformer.inner_dim, transformer.config.joint_attention_dim
    tensors = {"image_proj.proj.weight": _weights(tokens * text_dim, embed_dim, seed=1),
               "image_proj.proj.bias": _weights(tokens * text_dim, seed=2),
               "image_proj.norm.weight": torch.ones(text_dim), "image_proj.norm.bias": torch.zeros(text_dim)}
    for block in range(len(transformer.transformer_blocks)):
        for i, name in enumerate(("to_k_ip", "to_v_ip")):
            tensors[f"ip_adapter.{block}.{name}.weight"] = _weights(inner, text_dim, seed=10 + 4 * block + 2 * i)
            tensors[f"ip_adapter.{block}.{name}.bias"] = _weights(inner, seed=11 + 4 * block + 2 * i)
    save_file(tensors, folder / "ip_adapter.safetensors")
    return "ip_adapter.safetensors"


def _load_flux_adapter(pipe, folder, weight_name):
    pipe.load_ip_adapter(folder, subfolder="", weight_name=weight_name, image_encoder_pretrained_model_name_or_path=None)


@pytest.mark.parametrize("order", ORDERS)
def test_flux_pipeline_with_an_ip_adapter_equals_stock_and_serves_the_layers_own_attention(order, tmp_path):
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    pipe, kwargs = tiny_models.flux_pipeline()
    weight_name = _flux_adapter_file(pipe.transformer, tmp_path)
    image = dict(ip_adapter_image_embeds=[_weights(1, 1, 16, seed=30)],
                 negative_ip_adapter_image_embeds=[torch.zeros(1, 1, 16)])
    without = _latents(pipe, kwargs)
    _load_flux_adapter(pipe, tmp_path, weight_name)
    stock = _latents(pipe, kwargs, **image)
    stock_keys = set(pipe.transformer.state_dict())
    pipe.unload_ip_adapter()

    proc = TrtllmAttnProcessor(**DENSE)
    if order == "install_then_load":
        install(pipe, proc)
        _load_flux_adapter(pipe, tmp_path, weight_name)
    else:
        _load_flux_adapter(pipe, tmp_path, weight_name)
        install(pipe, proc)
    attach_denoise_tracking(pipe, proc)
    processors = pipe.transformer.attn_processors
    assert isinstance(processors["transformer_blocks.0.attn.processor"], FluxIPAdapterAttnProcessor)
    assert processors["single_transformer_blocks.0.attn.processor"] is proc
    assert set(pipe.transformer.state_dict()) == stock_keys  # the adapter's weights where Diffusers keeps them

    ours = _latents(pipe, kwargs, **image)
    assert not torch.allclose(stock, without, atol=1e-3)
    torch.testing.assert_close(ours, stock)
    routes, notes = _served_and_stock(proc, "transformer_blocks.0.attn")
    assert routes == {"reference", "stock"} and any(IMAGE_PROMPT in note for note in notes)
    assert _served_and_stock(proc, "single_transformer_blocks.0.attn") == ({"reference"}, set())

    pipe.set_ip_adapter_scale(0.0)  # Diffusers' own call reaches the adapter's processors
    torch.testing.assert_close(_latents(pipe, kwargs, **image), without)
    pipe.unload_ip_adapter()
    assert {id(p) for p in pipe.transformer.attn_processors.values()} == {id(proc)}
    torch.testing.assert_close(_latents(pipe, kwargs), without)


def test_uninstall_leaves_the_ip_adapter_loaded(tmp_path):
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    pipe, kwargs = tiny_models.flux_pipeline()
    weight_name = _flux_adapter_file(pipe.transformer, tmp_path)
    image = dict(ip_adapter_image_embeds=[_weights(1, 1, 16, seed=30)],
                 negative_ip_adapter_image_embeds=[torch.zeros(1, 1, 16)])
    _load_flux_adapter(pipe, tmp_path, weight_name)
    stock = _latents(pipe, kwargs, **image)
    install(pipe, TrtllmAttnProcessor(**DENSE))
    uninstall(pipe)
    block = pipe.transformer.transformer_blocks[0].attn
    assert isinstance(block.processor, FluxIPAdapterAttnProcessor) and layer_of(block) is None
    assert not block._forward_pre_hooks and not block._forward_hooks
    torch.testing.assert_close(_latents(pipe, kwargs, **image), stock)


# ---- Chroma (Flux's attention classes) and the UNet: the models' own loaders ------------------------------------
def _flux_adapter_state_dict(transformer, embed_dim: int = 16, tokens: int = 4) -> dict:
    """The state dict FluxTransformer2DLoadersMixin._load_ip_adapter_weights takes (Flux and Chroma)."""
    inner, text_dim = transformer.inner_dim, transformer.config.joint_attention_dim
    ip = {}
    for block in range(len(transformer.transformer_blocks)):
        for i, name in enumerate(("to_k_ip", "to_v_ip")):
            ip[f"{block}.{name}.weight"] = _weights(inner, text_dim, seed=10 + 4 * block + 2 * i)
            ip[f"{block}.{name}.bias"] = _weights(inner, seed=11 + 4 * block + 2 * i)
    proj = {"proj.weight": _weights(tokens * text_dim, embed_dim, seed=1), "proj.bias": _weights(tokens * text_dim, seed=2),
            "norm.weight": torch.ones(text_dim), "norm.bias": torch.zeros(text_dim)}
    return {"image_proj": proj, "ip_adapter": ip}


def _unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4,
                                out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
                                attention_head_dim=4, norm_num_groups=4).eval()
    inputs = dict(sample=_weights(1, 4, 8, 8, seed=40), timestep=torch.tensor(10),
                  encoder_hidden_states=_weights(1, 6, 16, seed=41), return_dict=False)
    return unet, inputs


def _unet_adapter_state_dict(unet, embed_dim: int = 12, tokens: int = 4) -> dict:
    """The state dict UNet2DConditionLoadersMixin._load_ip_adapter_weights takes: image keys and values of every
    cross-attention (the original checkpoints' odd ids, 1, 3, ...) and the image projection."""
    text_dim = unet.config.cross_attention_dim
    ip, key_id = {}, 1
    for name, module in unet.attn_processors.items():
        if name.endswith("attn2.processor"):
            hidden = unet.get_submodule(name.rsplit(".", 1)[0]).to_q.out_features
            for i, kind in enumerate(("to_k_ip", "to_v_ip")):
                ip[f"{key_id}.{kind}.weight"] = _weights(hidden, text_dim, seed=50 + key_id + i)
            key_id += 2
    proj = {"proj.weight": _weights(tokens * text_dim, embed_dim, seed=3), "proj.bias": _weights(tokens * text_dim, seed=4),
            "norm.weight": torch.ones(text_dim), "norm.bias": torch.zeros(text_dim)}
    return {"image_proj": proj, "ip_adapter": ip}


def _model_case(family: str):
    """(model, inputs without the adapter, inputs with it, the adapter's state dict, its processor class,
    one of its layers' names)."""
    if family == "unet":
        from diffusers.models.attention_processor import IPAdapterAttnProcessor2_0

        model, inputs = _unet()
        with_image = dict(inputs, added_cond_kwargs={"image_embeds": [_weights(1, 1, 12, seed=42)]})
        return (model, inputs, with_image, _unet_adapter_state_dict(model), IPAdapterAttnProcessor2_0,
                "down_blocks.0.attentions.0.transformer_blocks.0.attn2")
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    model, inputs = family_models.build("ChromaTransformer")
    with_image = dict(inputs, joint_attention_kwargs={"ip_adapter_image_embeds": [_weights(1, 1, 16, seed=42)]})
    return model, inputs, with_image, _flux_adapter_state_dict(model), FluxIPAdapterAttnProcessor, "transformer_blocks.0.attn"


def _forward(model, inputs):
    with torch.no_grad():
        out = model(**{k: dict(v) if isinstance(v, dict) else v for k, v in inputs.items()})  # (the model pops keys)
    return family_models._first_tensor(out)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("family", ["chroma", "unet"])
def test_models_with_an_ip_adapter_equal_stock(family, order):
    model, inputs, with_image, adapter, adapter_cls, layer_name = _model_case(family)
    stock_model, *_ = _model_case(family)
    without = _forward(stock_model, inputs)
    stock_model._load_ip_adapter_weights([adapter])
    expected = _forward(stock_model, with_image)
    assert not torch.allclose(expected, without, atol=1e-4)

    proc = TrtllmAttnProcessor(**DENSE)
    if order == "install_then_load":
        install(model, proc)
        model._load_ip_adapter_weights([adapter])
    else:
        model._load_ip_adapter_weights([adapter])
        install(model, proc)
    assert isinstance(model.get_submodule(layer_name).processor, adapter_cls)
    torch.testing.assert_close(_forward(model, with_image), expected)
    routes, notes = _served_and_stock(proc, layer_name)
    assert "reference" in routes and any(IMAGE_PROMPT in note for note in notes)


# ---- SD3: the pipeline's loader --------------------------------------------------------------------------------
def _sd3_adapter_file(transformer, folder, embed_dim: int = 16, queries: int = 4) -> str:
    """An IP-Adapter for ``transformer`` in SD3IPAdapterMixin's file layout: the image projection's parameters
    (``image_proj.*``, an ``IPAdapterTimeImageProjection`` of one 64-wide head) and each block's processor's
    (``ip_adapter.<block>.*``), made by Diffusers' own classes with seeded weights."""
    from diffusers.models.attention_processor import SD3IPAdapterJointAttnProcessor2_0
    from diffusers.models.embeddings import IPAdapterTimeImageProjection

    inner, head_dim = transformer.inner_dim, transformer.config.attention_head_dim
    torch.manual_seed(60)
    projection = IPAdapterTimeImageProjection(embed_dim=embed_dim, output_dim=inner, hidden_dim=64, heads=1,
                                              num_queries=queries, timestep_in_dim=32)
    tensors = {f"image_proj.{k}": v for k, v in projection.state_dict().items()}
    for block in range(len(transformer.transformer_blocks)):
        layer = SD3IPAdapterJointAttnProcessor2_0(hidden_size=inner, ip_hidden_states_dim=inner, head_dim=head_dim,
                                                  timesteps_emb_dim=64)
        tensors.update({f"ip_adapter.{block}.{k}": v * 3 for k, v in layer.state_dict().items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "sd3_ip_adapter.safetensors")
    return "sd3_ip_adapter.safetensors"


@pytest.mark.parametrize("order", ORDERS)
def test_sd3_pipeline_with_an_ip_adapter_equals_stock(order, tmp_path):
    from diffusers.models.attention_processor import SD3IPAdapterJointAttnProcessor2_0

    pipe, kwargs = tiny_models.sd3_pipeline()
    weight_name = _sd3_adapter_file(pipe.transformer, tmp_path)
    image = dict(ip_adapter_image_embeds=_weights(1, 3, 16, seed=61))

    def load():
        pipe.load_ip_adapter(tmp_path, subfolder="", weight_name=weight_name, image_encoder_folder=None)

    without = _latents(pipe, kwargs)
    load()
    stock = _latents(pipe, kwargs, **image)
    pipe.unload_ip_adapter()
    proc = TrtllmAttnProcessor(**DENSE)
    if order == "install_then_load":
        install(pipe, proc)
        load()
    else:
        load()
        install(pipe, proc)
    assert pipe.is_ip_adapter_active
    assert all(isinstance(block.attn.processor, SD3IPAdapterJointAttnProcessor2_0)
               for block in pipe.transformer.transformer_blocks)
    ours = _latents(pipe, kwargs, **image)
    assert not torch.allclose(stock, without, atol=1e-3)
    torch.testing.assert_close(ours, stock)
    routes, notes = _served_and_stock(proc, "transformer_blocks.0.attn")
    assert routes == {"reference", "stock"} and any(IMAGE_PROMPT in note for note in notes)
    pipe.unload_ip_adapter()
    assert {id(p) for p in pipe.transformer.attn_processors.values()} == {id(proc)}
    torch.testing.assert_close(_latents(pipe, kwargs), without)


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
