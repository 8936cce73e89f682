"""Rotary embeddings applied in a family processor's stead, where its eager form is slow.

A stock processor listed in :data:`DEFERRED` is called with its rotary argument set to None; its attention call
then gets Q and K turned by our one-launch kernel (:func:`diffusers_trtllm.kernels.rotary.rotate_interleaved`,
bit for bit the processor's values) before anything sees them: our kernels, the stock fallback, the
calibration pass. That holds only where the processor makes one attention call and rotates exactly its Q and K (or,
HunyuanVideo's, their leading video tokens; CogVideoX's, their trailing ones): Wan's attention without image projections (with them, the image
call's keys are not rotated, so the layer keeps its own rotation), Flux's, Flux.2's, HunyuanVideo's,
LTX-Video's, Qwen-Image's and CogVideoX's attention. Where ``serves`` says no, or the call passes no rotary argument, nothing
changes.
docs/design.md, "Rotary embeddings in one launch".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..kernels.rotary import rotate_interleaved

__all__ = ["DeferredRotary", "DEFERRED", "deferred_rotary", "take_rotary"]

#: What turns Q and K at the attention call: ``turn(query, key) -> (query, key)``.
Turn = Callable[[torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]


@dataclass(frozen=True)
class DeferredRotary:
    """How one stock processor class's rotation is taken over."""

    #: The processor's parameter holding the rotary embedding.
    argument: str
    #: ``rotate(query, key, embedding)``: Q and K as the processor would have rotated them.
    rotate: Callable[[torch.Tensor, torch.Tensor, Any], "tuple[torch.Tensor, torch.Tensor]"]
    #: Whether this module's call rotates the Q and K of its only attention call.
    serves: Callable[[torch.nn.Module], bool]
    #: The parameter's position after ``attn`` (filled by ``deferred_rotary``).
    index: int = -1


def _wan_rotate(query: torch.Tensor, key: torch.Tensor, rotary_emb: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's: ``(freqs_cos, freqs_sin)`` as ``[1, S, 1, D]`` tables, one angle per pair."""
    freqs_cos, freqs_sin = rotary_emb
    return rotate_interleaved(query, key, freqs_cos, freqs_sin, rule="pair")


def _diffusers_rotate(query: torch.Tensor, key: torch.Tensor, image_rotary_emb: Any,
                      start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Diffusers' ``apply_rotary_emb(x, image_rotary_emb, sequence_dim=1)``, as Flux's and HunyuanVideo's processors
    call it: ``[R, D]`` tables put on Q's device and indexed ``[None, :, None, :]`` as Diffusers does, each output its
    own entries. HunyuanVideo's tables cover the video tokens, which come first in its joint Q and K (the text's
    follow, unturned): the ``R`` tokens from ``start`` (0) are turned."""
    freqs_cos, freqs_sin = (f.to(query.device)[None, :, None, :] for f in image_rotary_emb)
    return rotate_interleaved(query, key, freqs_cos, freqs_sin, rule="element", start=start)


def _ltx_rotate(query: torch.Tensor, key: torch.Tensor, image_rotary_emb: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """LTX-Video's (its module's ``apply_rotary_emb``, on Q and K before they are split into heads): ``[B, S, H * D]``
    tables, one pair of entries per channel pair, which split into heads give each (token, head) its own
    ``[D]`` row; so tokens and heads are taken as one axis of ``S * H`` rows of one head."""
    batch, tokens, heads, dim = query.shape
    freqs_cos, freqs_sin = (f.reshape(f.shape[0], tokens * heads, 1, dim) for f in image_rotary_emb)
    q, k = rotate_interleaved(query.reshape(batch, tokens * heads, 1, dim), key.reshape(batch, tokens * heads, 1, dim),
                              freqs_cos, freqs_sin, rule="element")
    return q.view(query.shape), k.view(key.shape)


def _qwen_rotate(query: torch.Tensor, key: torch.Tensor, image_rotary_emb: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-Image's (``apply_rotary_emb_qwen(..., use_real=False)`` on the image's and the text's Q and K, before they
    are joined text first): complex ``[S, D / 2]`` tables ``(image, text)``, joined in the same order and viewed as
    float32 pairs, for the ``"complex"`` rule."""
    image_freqs, text_freqs = image_rotary_emb
    table = torch.cat((text_freqs, image_freqs)).to(query.device)
    if table.shape[0] != query.shape[1]:
        raise ValueError(f"Qwen-Image's rotary tables cover {text_freqs.shape[0]} text and {image_freqs.shape[0]} "
                         f"image tokens, but the joint Q holds {query.shape[1]}: pass the tables its transformer made "
                         "for these inputs.")
    pairs = torch.view_as_real(table).flatten(-2)[None, :, None, :]
    return rotate_interleaved(query, key, pairs, pairs, rule="complex")


def _cogvideox_rotate(query: torch.Tensor, key: torch.Tensor, image_rotary_emb: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """CogVideoX's (``apply_rotary_emb`` on the video tokens, which follow the text's in its joint Q and K): ``[R, D]``
    tables of the last ``R`` tokens, ``"element"`` rule, turned in the same launch that copies the text's tokens as
    they are."""
    video = image_rotary_emb[0].shape[0]
    text = query.shape[1] - video
    if text < 0:
        raise ValueError(f"CogVideoX's rotary tables cover {video} video tokens, more than the joint Q's "
                         f"{query.shape[1]}: pass the tables its transformer made for these inputs.")
    return _diffusers_rotate(query, key, image_rotary_emb, start=text)


def _without_image_projections(attn: torch.nn.Module) -> bool:
    return getattr(attn, "add_k_proj", None) is None


def _always(attn: torch.nn.Module) -> bool:
    return True


def _self_attention(attn: torch.nn.Module) -> bool:  # (CogVideoX's cross-attention would turn only Q)
    return not getattr(attn, "is_cross_attention", False)


_WAN = DeferredRotary("rotary_emb", _wan_rotate, _without_image_projections)
_DIFFUSERS = DeferredRotary("image_rotary_emb", _diffusers_rotate, _always)
_LTX = DeferredRotary("image_rotary_emb", _ltx_rotate, _always)
_QWEN = DeferredRotary("image_rotary_emb", _qwen_rotate, _always)
_COGVIDEOX = DeferredRotary("image_rotary_emb", _cogvideox_rotate, _self_attention)
#: Stock processor classes (module and qualified name, matched exactly: a subclass may rotate otherwise): Wan's and
#: the copies of it (ChronoEdit, Wan-Animate, SkyReels-V2); Flux's and Flux.2's, which rotate the joint Q and K of
#: their one attention call; HunyuanVideo's (1.0, its FramePack form, 1.5), which rotate the video tokens of theirs;
#: LTX-Video's self-attention (its cross-attention gets no rotary argument); Qwen-Image's joint attention (its text's
#: and image's Q and K each rotated by their own tables, then joined); CogVideoX's (and its fused-projection form),
#: which rotate the video tokens after the text's in their one call, through ``F.scaled_dot_product_attention``.
DEFERRED: dict[str, DeferredRotary] = {
    **{f"diffusers.models.transformers.{name}": _WAN for name in (
        "transformer_wan.WanAttnProcessor", "transformer_chronoedit.WanAttnProcessor",
        "transformer_wan_animate.WanAttnProcessor", "transformer_skyreels_v2.SkyReelsV2AttnProcessor")},
    **{f"diffusers.models.transformers.{name}": _DIFFUSERS for name in (
        "transformer_flux.FluxAttnProcessor", "transformer_flux2.Flux2AttnProcessor",
        "transformer_flux2.Flux2ParallelSelfAttnProcessor", "transformer_hunyuan_video.HunyuanVideoAttnProcessor2_0",
        "transformer_hunyuan_video15.HunyuanVideo15AttnProcessor2_0")},
    "diffusers.models.transformers.transformer_ltx.LTXVideoAttnProcessor": _LTX,
    "diffusers.models.transformers.transformer_qwenimage.QwenDoubleStreamAttnProcessor2_0": _QWEN,
    **{f"diffusers.models.attention_processor.{name}": _COGVIDEOX for name in (
        "CogVideoXAttnProcessor2_0", "FusedCogVideoXAttnProcessor2_0")},
}


def deferred_rotary(stock: Any, params: list[str]) -> DeferredRotary | None:
    """``stock``'s entry in :data:`DEFERRED`, with its argument's position among ``params`` (its ``__call__``'s
    parameters after ``attn``); None when its class is not listed or takes no such argument."""
    cls = type(stock)
    entry = DEFERRED.get(f"{cls.__module__}.{cls.__qualname__}")
    if entry is None or entry.argument not in params:
        return None
    return replace(entry, index=params.index(entry.argument))


def take_rotary(deferred: DeferredRotary, attn: torch.nn.Module, args: tuple,
                kwargs: dict) -> tuple[tuple, dict, Turn | None]:
    """``args`` and ``kwargs`` with the rotary argument taken out (None), and what turns Q and K in its stead;
    unchanged, with None, where this call has nothing to take."""
    if not deferred.serves(attn):
        return args, kwargs, None
    if deferred.argument in kwargs:
        embedding = kwargs[deferred.argument]
        kwargs = {**kwargs, deferred.argument: None}
    elif deferred.index < len(args):
        embedding = args[deferred.index]
        args = args[:deferred.index] + (None,) + args[deferred.index + 1:]
    else:
        return args, kwargs, None
    if embedding is None:
        return args, kwargs, None
    return args, kwargs, lambda query, key: deferred.rotate(query, key, embedding)
