"""User-facing controls: skip-softmax sparsity and SAGE quantization.

The names match vLLM-Omni's ``TRTLLM_ATTN`` backend so a configuration carries
over unchanged. Every bad value raises ``ValueError`` naming the control, the
value and the allowed range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch

__all__ = ["SkipSoftmaxConfig", "QuantConfig", "QK_QUANT_DTYPES", "BLOCK_SIZES"]

#: Quantized dtypes SAGE accepts for Q and K, by their configuration name.
QK_QUANT_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
}
#: Aliases a user may write for ``dtype_qk``.
_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3"}
#: Token block sizes a SAGE scale may cover.
BLOCK_SIZES = (1, 4, 16)


def _check_range(name: str, value: Any, lo: float, hi: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number; got {value!r} ({type(value).__name__}).")
    v = float(value)
    if not math.isfinite(v) or v < lo or (hi is not None and v > hi):
        allowed = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be finite and {allowed}; got {value!r}.")
    return v


@dataclass(frozen=True)
class SkipSoftmaxConfig:
    """When and how hard to skip KV tiles (BLASST / TRT-LLM skip-softmax).

    ``threshold`` gives ``lambda`` directly; ``target_sparsity`` needs a
    calibration curve ``factor = a * exp(b * target_sparsity)``. Skipping is
    off while the normalized timestep ``t > disabled_until_timestep``.
    """

    threshold: float | None = None
    target_sparsity: float | None = None
    disabled_until_timestep: float = 0.0
    a: float | None = None
    b: float | None = None

    def __post_init__(self) -> None:
        _check_range("skip_softmax_threshold", self.threshold, 0.0, None)
        _check_range("target_sparsity", self.target_sparsity, 0.0, 1.0)
        _check_range("disabled_until_timestep", self.disabled_until_timestep, 0.0, 1.0)
        _check_range("calibration a", self.a, 0.0, None)
        _check_range("calibration b", self.b, -math.inf, None)
        if self.threshold is not None and self.target_sparsity is not None:
            raise ValueError(
                "skip_softmax_threshold and target_sparsity are exclusive; got both "
                f"({self.threshold!r}, {self.target_sparsity!r}). Pass one of them."
            )
        if (self.a is None) != (self.b is None):
            raise ValueError(f"calibration needs both a and b; got a={self.a!r}, b={self.b!r}.")
        if self.a is not None and self.a <= 0.0:
            raise ValueError(f"calibration a must be > 0; got {self.a!r}.")

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any] | None) -> "SkipSoftmaxConfig":
        """Build from vLLM-Omni style ``backend_kwargs`` (unknown keys are ignored here)."""
        kw = kwargs or {}
        return cls(
            threshold=kw.get("skip_softmax_threshold"),
            target_sparsity=kw.get("target_sparsity"),
            disabled_until_timestep=kw.get("disabled_until_timestep", 0.0) or 0.0,
        )

    def with_calibration(self, a: float, b: float) -> "SkipSoftmaxConfig":
        return replace(self, a=float(a), b=float(b))

    @property
    def configured(self) -> bool:
        """The user asked for skipping (it may still need a calibration)."""
        return self.threshold is not None or self.target_sparsity is not None

    @property
    def gated(self) -> bool:
        return self.disabled_until_timestep > 0.0

    def active_at(self, timestep: float | None) -> bool:
        """Whether skipping applies at normalized timestep ``t`` (None: unknown)."""
        if not self.configured:
            return False
        if not self.gated:
            return True
        return timestep is not None and timestep <= self.disabled_until_timestep

    def scale_factor(self, max_kv_len: int) -> float:
        """The kernel's ``skip_softmax_threshold_scale_factor``: ``lambda = factor / kv_len``.

        From a threshold the factor is ``threshold * max_kv_len``, so the longest
        sequence sees ``lambda = threshold`` (as vLLM-Omni computes it).
        """
        if self.threshold is not None:
            return self.threshold * max_kv_len
        if self.target_sparsity is None:
            raise ValueError("scale_factor() called with skip-softmax not configured.")
        if self.a is None or self.b is None:
            raise ValueError(
                f"target_sparsity={self.target_sparsity!r} needs a calibration (a, b) for this layer, "
                "and none is set. Load one with diffusers_trtllm.load_calibration(...) or "
                "pass skip_softmax_threshold instead."
            )
        return self.a * math.exp(self.b * self.target_sparsity)


@dataclass(frozen=True)
class QuantConfig:
    """SAGE quantization: Q/K per-block int8 or fp8 e4m3 scales, V fp8 per channel."""

    dtype_qk: str | None = None
    q_block_size: int = 1
    k_block_size: int = 16
    smooth_k: bool = False

    def __post_init__(self) -> None:
        if self.dtype_qk is not None:
            name = _DTYPE_ALIASES.get(str(self.dtype_qk), self.dtype_qk)
            if name not in QK_QUANT_DTYPES:
                raise ValueError(
                    f"quant.dtype_qk must be one of {sorted(QK_QUANT_DTYPES)} (or None for no SAGE); "
                    f"got {self.dtype_qk!r}. float16/bfloat16 are not SAGE dtypes."
                )
            object.__setattr__(self, "dtype_qk", name)
        for field in ("q_block_size", "k_block_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value not in BLOCK_SIZES:
                raise ValueError(f"quant.{field} must be one of {BLOCK_SIZES}; got {value!r}.")
        if not isinstance(self.smooth_k, bool):
            raise ValueError(f"quant.smooth_k must be True or False; got {self.smooth_k!r}.")

    @classmethod
    def from_kwargs(cls, quant: "Mapping[str, Any] | QuantConfig | None") -> "QuantConfig":
        """Build from the ``quant={...}`` dict; unknown keys raise (they would be silently dropped)."""
        if isinstance(quant, QuantConfig):
            return quant
        q = dict(quant or {})
        unknown = sorted(set(q) - {"dtype_qk", "q_block_size", "k_block_size", "smooth_k"})
        if unknown:
            raise ValueError(
                f"quant has unknown keys {unknown}; allowed: dtype_qk, q_block_size, k_block_size, smooth_k."
            )
        return cls(
            dtype_qk=q.get("dtype_qk"),
            q_block_size=q.get("q_block_size", 1),
            k_block_size=q.get("k_block_size", 16),
            smooth_k=q.get("smooth_k", False),
        )

    @property
    def enabled(self) -> bool:
        return self.dtype_qk is not None

    @property
    def qk_dtype(self) -> torch.dtype:
        if self.dtype_qk is None:
            raise ValueError("quant.dtype_qk is not set; SAGE is off.")
        return QK_QUANT_DTYPES[self.dtype_qk]

    @property
    def qk_max(self) -> float:
        """Largest magnitude of the quantized Q/K grid (``M`` in DESIGN.md)."""
        return 127.0 if self.dtype_qk == "int8" else 448.0
