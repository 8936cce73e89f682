"""Tiny models of every Diffusers transformer family, built from ``data/tiny_family_configs.json``.

The JSON holds, per configuration, the model class, its init arguments and its forward
inputs, sized like Diffusers' own model tests (tests/models/transformers/*, read as a guide).
Float tensors are stored by shape (drawn again from a seeded generator) unless they are
constant or hold at most two values (masks); integer tensors (ids, timesteps) by value.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

DATA = Path(__file__).parent / "data" / "tiny_family_configs.json"


@lru_cache(maxsize=1)
def configs() -> dict[str, dict[str, Any]]:
    return json.loads(DATA.read_text())


def _decode(value: Any, generator: torch.Generator) -> Any:
    if isinstance(value, list):
        return [_decode(v, generator) for v in value]
    if not isinstance(value, dict):
        return value
    if "tuple" in value:
        return tuple(_decode(v, generator) for v in value["tuple"])
    if "dict" in value:  # JSON keys are strings; "int_keys" marks a dict keyed by int (OmniGen's image sizes)
        return {int(k) if value.get("int_keys") else k: _decode(v, generator) for k, v in value["dict"].items()}
    dtype = getattr(torch, value["dtype"])
    shape = value["tensor"]
    if "fill" in value:
        return torch.full(shape, value["fill"], dtype=dtype)
    if "values" in value:
        return torch.tensor(value["values"], dtype=dtype).reshape(shape)
    return torch.randn(shape, generator=generator).to(dtype)


def build(name: str, seed: int = 0) -> tuple[torch.nn.Module, dict[str, Any]]:
    """``(model, inputs)`` of configuration ``name``, in eval mode."""
    import diffusers

    config = configs()[name]
    generator = torch.Generator().manual_seed(seed)
    init = _decode(config["init"], generator)
    inputs = _decode(config["inputs"], generator)
    torch.manual_seed(seed)
    model = getattr(diffusers, config["class"])(**init)
    return model.eval(), inputs


#: Softmax attention calls left stock by design, per configuration: (calls per forward, why).
STOCK_BY_DESIGN = {
    "HunyuanDiT": (1, "text pooling (F.multi_head_attention_forward) in the embedder, outside any attention module"),
    "MochiTransformer": (1, "text pooling (one query) in the embedder, outside any attention module"),
    "AnyFlowFARTransformer3D": (2, "block-causal flex attention (a BlockMask): causal calls stay stock"),
    "Cosmos3OmniTransformer": (2, "the causal half of its attention (is_causal=True) stays stock"),
    "Kandinsky6SRTransformer": (2, "NABLA block-sparse flex attention (a BlockMask) stays stock"),
}
#: Calls that reach our op but keep the stock path, by design: configuration -> why.
MASKS_KEPT_STOCK = {
    "QwenImage21Transformer": "its block-causal text segments (a causal triangle per segment) keep the stock path",
}


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        tensors = [_first_tensor(o) for o in out]
        return tensors[0] if len(tensors) == 1 or len({t.shape for t in tensors}) > 1 else torch.stack(tensors)
    if isinstance(out, dict):
        return _first_tensor(next(iter(out.values())))
    return _first_tensor(out.sample)


def check_family(name: str, processor_kwargs: dict | None = None, grad_mode: Any = torch.no_grad) -> dict[str, Any]:
    """Run configuration ``name`` stock and with ``TrtllmAttnProcessor`` (dense): what was served.

    ``grad_mode``: the context both runs are made in (``torch.inference_mode`` is what many users write).

    Counts softmax attention calls (``F.scaled_dot_product_attention`` and flex attention, wherever
    called) in the stock run, and in our run those served by our op and those that still ran stock.
    """
    import torch.nn.attention.flex_attention as flex
    import torch.nn.functional as F

    from diffusers_trtllm import TrtllmAttnProcessor, install, uninstall
    from diffusers_trtllm.serving.layer import LayerState

    counts = {"softmax": 0, "served": 0}
    originals = (F.scaled_dot_product_attention, flex.flex_attention, LayerState.serve)

    def counted(fn):
        def call(*args, **kwargs):
            counts["softmax"] += 1
            return fn(*args, **kwargs)
        return call

    def serve(self, *args, **kwargs):
        before = counts["softmax"]
        try:
            return originals[2](self, *args, **kwargs)
        finally:
            counts["softmax"] = before
            counts["served"] += 1

    model, inputs = build(name)
    F.scaled_dot_product_attention, flex.flex_attention = counted(originals[0]), counted(originals[1])
    LayerState.serve = serve
    try:
        with grad_mode():
            stock = _first_tensor(model(**inputs))
        stock_calls = counts["softmax"]
        counts.update(softmax=0, served=0)
        proc = TrtllmAttnProcessor(**(processor_kwargs or {}))
        install(model, proc)
        with grad_mode():
            ours = _first_tensor(model(**inputs))
    finally:
        F.scaled_dot_product_attention, flex.flex_attention, LayerState.serve = originals
    layers = proc.layers
    result = {
        "config": name,
        "class": configs()[name]["class"],
        "stock": stock,
        "ours": ours,
        "stock_calls": stock_calls,
        "served_calls": counts["served"],
        "unserved_calls": counts["softmax"],
        "roles": sorted({s.role for s in layers if s.mode is not None}),
        "modes": sorted({s.mode for s in layers if s.mode is not None}),
        "routes": sorted({r for s in layers for rec in s.records for r in rec.routes}),
        "unserved_layers": sorted({f"{type(s.stock).__name__}: {s.reason}" for s in layers if s.mode is None}),
    }
    uninstall(model)
    return result
