"""A layer's attention role, from the module's structure and from what its first call does.

Roles: ``self``, ``cross`` (K/V come from the encoder states), ``joint`` (a second
stream concatenated with the first, as in MM-DiT blocks), ``refiner`` (HunyuanVideo's
token refiner, the one role known by name). Before a layer has run, its role is a
guess from the module (flags and added projections); its first served call settles
it from the token counts: queries, keys, and the ``hidden_states`` /
``encoder_hidden_states`` the processor was given. Names alone mislead (Kandinsky 5's
cross-attention, OmniGen's self-attention, HiDream's and CogView4's joint attention).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ROLES", "guess_role", "observed_role"]

ROLES = ("self", "cross", "joint", "refiner")


def guess_role(name: str | None, module: torch.nn.Module) -> str:
    """The role before any call: refiner by name; cross by the module's flag (or, where a module has no
    such flag, as LTX's, the name ``attn2`` without added projections); joint by added K/V projections."""
    if "refiner" in (name or ""):
        return "refiner"
    added = getattr(module, "added_kv_proj_dim", None) is not None or getattr(module, "add_k_proj", None) is not None
    cross = getattr(module, "is_cross_attention", None)
    if cross is None:
        cross = (name or "").rsplit(".", 1)[-1] == "attn2" and not added
    if cross is True:
        return "cross"
    return "joint" if added else "self"


def observed_role(guess: str, module_is_cross: Any, q_len: int, kv_len: int, hidden_len: int, encoder_len: int) -> str:
    """The role a call shows (token counts; -1 where the processor got no such input).

    - no encoder states passed: ``self`` (a single stream, maybe already concatenated);
    - keys as many as the encoder's tokens, or fewer keys than queries drawn from it
      (Wan I2V's image and text halves): ``cross``;
    - queries or keys spanning hidden + encoder tokens: ``joint``;
    - queries and keys only over the hidden tokens: ``self``.
    """
    if guess == "refiner":
        return guess
    if encoder_len < 0:
        return "cross" if module_is_cross is True and kv_len != q_len else "self"
    if hidden_len > 0 and (kv_len == hidden_len + encoder_len or q_len == hidden_len + encoder_len):
        return "joint"
    if kv_len == encoder_len and (kv_len != q_len or module_is_cross is True or guess == "cross"):
        return "cross"
    if kv_len != q_len and kv_len <= encoder_len:
        return "cross"
    if q_len == kv_len == hidden_len:
        return "self"
    return guess
