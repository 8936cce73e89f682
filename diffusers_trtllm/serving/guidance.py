"""Diffusers' layer-skip guidance (``apply_layer_skip``, the ``SkipLayerGuidance`` and
``PerturbedAttentionGuidance`` guiders) on layers we serve.

Diffusers perturbs a layer in two ways, and both hold with our processor, in either order
of ``install`` and the hooks:

- ``skip_attention``: the hook returns the output its ``AttentionProcessorRegistry`` names for
  the layer's processor class. Ours is registered (:func:`register_skip_output`, while
  Diffusers' setters are wrapped) with the output of the layer's *stock* processor.
- ``skip_attention_scores``: the hook runs the layer under a ``TorchFunctionMode`` that answers
  ``F.scaled_dot_product_attention`` with its ``value``. Our op never calls that function, so
  while the mode is active (:func:`attention_scores_skipped`) the call keeps its stock path,
  where the mode sees it; every other layer stays on our kernels.

See docs/design.md ("How a call flows").
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["register_skip_output", "unregister_skip_output", "attention_scores_skipped"]


def _stock_skip_output(attn: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What Diffusers' layer-skip returns for a layer we serve: its stock processor's skip output."""
    from diffusers.hooks._helpers import AttentionProcessorRegistry

    stock = attn.processor._stock_processor(attn)  # the hook looked our class up, so ours is the processor
    if stock is None:
        raise ValueError(f"layer-skip cannot skip {type(attn).__name__}: TrtllmAttnProcessor knows no stock processor "
                         "for it; install the processor with diffusers_trtllm.install(model, proc) first.")
    return AttentionProcessorRegistry.get(type(stock)).skip_processor_output_fn(attn, *args, **kwargs)


def register_skip_output(ours: type) -> None:
    """Name ``ours`` in Diffusers' ``AttentionProcessorRegistry`` (keyed by our class: stock lookups are unchanged)."""
    from diffusers.hooks._helpers import AttentionProcessorMetadata, AttentionProcessorRegistry

    AttentionProcessorRegistry.register(ours, AttentionProcessorMetadata(skip_processor_output_fn=_stock_skip_output))


def unregister_skip_output(ours: type) -> None:
    """Take ``ours`` out of Diffusers' registry again (it offers no public way to)."""
    from diffusers.hooks._helpers import AttentionProcessorRegistry

    AttentionProcessorRegistry._registry.pop(ours, None)


def attention_scores_skipped() -> bool:
    """Whether layer-skip guidance is answering ``F.scaled_dot_product_attention`` in this thread (its
    ``skip_attention_scores`` mode is active), so the call must reach that function to be perturbed."""
    from diffusers.hooks.layer_skip import AttentionScoreSkipFunctionMode

    if not torch._C._len_torch_function_stack():
        return False
    return any(isinstance(mode, AttentionScoreSkipFunctionMode)
               for mode in torch.overrides._get_current_function_mode_stack())
