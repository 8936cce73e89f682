"""Every transformer family Diffusers exports, tiny: dense output equals stock, and our kernels ran
on every softmax attention call its attention modules make (``tests/data/tiny_family_configs.json``).

``scripts/families_table.py`` turns the same checks into docs/families.md's table.
"""

from __future__ import annotations

import pytest
import torch

import family_models

#: Exported classes with no tiny configuration here, and why (listed in docs/families.md).
NOT_TESTED = {
    "BriaFibo2Transformer2DModel": "no tiny configuration yet",
    "RFD4ProteinaTransformer": "no tiny configuration yet",
    "SanaWMLTX2RefinerTransformer3DModel": "no tiny configuration yet",
    "SanaWMTransformer3DModel": "no tiny configuration yet",
    "WanAnimate2Transformer3DModel": "no tiny configuration yet",
}
#: Layers kept stock by design (no softmax to serve): processor class -> why.
LINEAR_ATTENTION = {"SanaLinearAttnProcessor2_0", "SanaLinearAttnProcessor3_0"}


def exported_transformer_classes() -> set[str]:
    import diffusers
    from diffusers.models.modeling_utils import ModelMixin

    names = {n for n in dir(diffusers) if "Transformer" in n or n == "UNet2DConditionModel"}
    return {n for n in names if isinstance(getattr(diffusers, n), type) and issubclass(getattr(diffusers, n), ModelMixin)}


def test_every_exported_class_is_tested_or_listed():
    tested = {c["class"] for c in family_models.configs().values()}
    missing = exported_transformer_classes() - tested - set(NOT_TESTED)
    assert not missing, f"exported transformer classes with no tiny configuration and no reason: {sorted(missing)}"


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
@pytest.mark.parametrize("name", sorted(family_models.configs()))
def test_dense_equals_stock_and_every_softmax_call_is_served(name, grad_mode):
    result = family_models.check_family(name, grad_mode=grad_mode)
    torch.testing.assert_close(result["ours"], result["stock"], rtol=1e-5, atol=1e-5)
    outside, _ = family_models.STOCK_BY_DESIGN.get(name, (0, ""))
    assert result["unserved_calls"] == outside, result
    assert result["served_calls"] == result["stock_calls"] - outside, result
    assert all(layer.split(":")[0] in LINEAR_ATTENTION for layer in result["unserved_layers"]), result
    # Calls kept stock by design inside attention modules (causal, flex masks) show as "stock" in the table.
    allowed = {"sdpa", "stock"} if name in family_models.MASKS_KEPT_STOCK or outside else {"sdpa"}
    assert set(result["routes"]) <= allowed, result
