"""User-facing controls: skip-softmax sparsity and SAGE quantization.

The names match vLLM-Omni's ``TRTLLM_ATTN`` backend so a configuration carries
over unchanged. Every bad value raises ``ValueError`` naming the control, the
value and what is allowed; a value of the wrong type raises ``ControlTypeError``
(a ``TypeError`` that is also a ``ValueError``).

Accepted forms (``SkipSoftmaxConfig.coerce`` / ``QuantConfig.coerce``):

- skip: ``None``, a ``SkipSoftmaxConfig``, a number (the threshold), or a dict with
  ``threshold`` / ``skip_softmax_threshold``, ``target_sparsity``, ``disabled_until_timestep``.
- quant: ``None``, a ``QuantConfig``, a dtype name (``"int8"``, ``"fp8_e4m3"``, ``"fp8"``)
  or ``torch.int8`` / ``torch.float8_e4m3fn``, or a dict with ``dtype_qk``,
  ``q_block_size``, ``k_block_size``, ``k_per_thread``, ``smooth_k``. ``k_block_size`` and ``k_per_thread``
  left out (None) are the route's choice: ``DEFAULT_K_BLOCK`` (16, FlashInfer's) on every route but
  ``sage-sm90``, which takes 128 (split per thread as ``sage_sm90.K_PER_THREAD`` says). ``smooth_k`` is on
  unless set False: trained models' keys carry a per-channel mean shared by every token, which softmax ignores
  but int8's per-block scales do not (docs/design.md, "K's mean").

``skip_softmax_threshold`` must lie in [0, 1): it is the longest sequence's
``lambda``, and a tile is skipped when its scores stay below ``lambda`` times the
running maximum; at ``lambda >= 1`` every tile after the first would go.
"""

from __future__ import annotations

import difflib
import math
import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Mapping

if TYPE_CHECKING:
    import torch

__all__ = [
    "SkipSoftmaxConfig", "QuantConfig", "QK_QUANT_DTYPES", "BLOCK_SIZES", "K_BLOCK_SIZES", "DEFAULT_K_BLOCK", "K_PER_THREAD_BLOCKS", "ControlTypeError", "unknown_keys_message",
    "POLICIES", "ROUTE_NAMES", "CPU_ROUTES", "GROUP_BY", "check_fit_range", "DENOISER_PREFIXES", "is_denoiser_name",
]

# This module imports no torch: the command line checks its values with it before the slow imports.

#: ``policy`` values (``policy.apply_policy``): "auto" drops what cannot pay off on a call, "always" honours it.
POLICIES = ("auto", "always")
#: The built-in routes' names in priority order (``routes.route_names()`` once they are loaded), and those
#: that run on the CPU; ``tests/test_cli.py`` checks both against the registered routes.
ROUTE_NAMES = ("trtllm-gen", "fa3", "fmha-v2", "fmha-v2-fp8", "sage-sm90", "triton", "sdpa", "gluon", "reference")
CPU_ROUTES = ("sdpa", "reference")
#: How ``calibrate()`` pools layers into curves: one per transformer (ModelOpt's layout), per role, or per layer.
GROUP_BY = ("transformer", "role", "layer")
#: Pipeline components served (``serving.modules``): names starting with these.
DENOISER_PREFIXES = ("transformer", "unet", "prior", "decoder")
#: ``torch.finfo(torch.float32).max``: a skip factor must fit in the kernels' fp32.
_FLOAT32_MAX = 3.4028234663852886e38


class ControlTypeError(TypeError, ValueError):
    """A control got a value of the wrong type (a ``TypeError``; also a ``ValueError`` for callers catching those)."""


def unknown_keys_message(where: str, unknown: Iterable[str], allowed: Iterable[str], what: str = "keys") -> str:
    """``"<where> has unknown keys ..."`` with the closest allowed key for each (a misspelling, or a short
    form such as ``threshold`` for ``skip_softmax_threshold``), and the allowed ones."""
    allowed = list(allowed)
    parts = []
    for key in sorted(map(str, unknown)):
        close = difflib.get_close_matches(key, allowed, n=1) or [a for a in allowed if key and key in a][:1]
        parts.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    return f"{where} has unknown {what} {', '.join(parts)}; allowed: {', '.join(allowed)}."


def is_denoiser_name(name: str) -> bool:
    """Whether a pipeline component named ``name`` is a denoiser (``transformer``, ``transformer_2``, ``unet``, ...)."""
    return name.startswith(DENOISER_PREFIXES)


def check_mapping(name: str, value: Any, example: str) -> Mapping[str, Any]:
    """``value`` if it is a dict, else a ``ControlTypeError`` showing ``example``."""
    if not isinstance(value, Mapping):
        raise ControlTypeError(f"{name} must be a dict like {example}; got {value!r} ({type(value).__name__}).")
    return value

#: Quantized dtypes SAGE accepts for Q and K: configuration name -> ``torch`` attribute.
QK_QUANT_DTYPES: dict[str, str] = {
    "int8": "int8",
    "fp8_e4m3": "float8_e4m3fn",
}
#: Aliases a user may write for ``dtype_qk``.
_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3"}
#: Token block sizes a SAGE scale may cover (FlashInfer's SAGE layout).
BLOCK_SIZES = (1, 4, 16)
#: K block sizes: FlashInfer's, and 128, one scale per KV tile of the project's own kernels (FlashInfer's
#: kernels do not take it); on sage-sm90 a thread's whole row of a tile then shares one K scale.
K_BLOCK_SIZES = (*BLOCK_SIZES, 128)
#: The K block of a call that leaves ``k_block_size`` to the route (``QuantConfig.with_k_block``), on every route
#: but ``sage-sm90``: FlashInfer's and vLLM-Omni's default.
DEFAULT_K_BLOCK = 16
#: K blocks that ``k_per_thread`` may split: each holds whole groups of 8 keys, which the split deals out.
K_PER_THREAD_BLOCKS = (16, 128)


def _dtype_name(dtype_qk: Any) -> str:
    """The configuration name of a SAGE Q/K dtype given by name, alias or ``torch.dtype``."""
    if _is_torch_dtype(dtype_qk):
        names = {v: k for k, v in QK_QUANT_DTYPES.items()}
        if str(dtype_qk).removeprefix("torch.") in names:
            return names[str(dtype_qk).removeprefix("torch.")]
    elif isinstance(dtype_qk, str):
        name = _DTYPE_ALIASES.get(dtype_qk.lower(), dtype_qk.lower())
        if name in QK_QUANT_DTYPES:
            return name
    else:
        raise ControlTypeError(
            f"quant.dtype_qk must be a dtype name ({', '.join(map(repr, QK_QUANT_DTYPES))}) or None; "
            f"got {dtype_qk!r} ({type(dtype_qk).__name__})."
        )
    raise ValueError(
        f"quant.dtype_qk must be one of {sorted(QK_QUANT_DTYPES)} (or None for no SAGE); "
        f"got {dtype_qk!r}. float16/bfloat16 are not SAGE dtypes."
    )


def _is_torch_dtype(value: Any) -> bool:
    """Whether ``value`` is a ``torch.dtype`` (without importing torch: if it is not loaded, none exists)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.dtype)


def check_fit_range(fit_range: Any) -> tuple[float, float]:
    """``calibrate()``'s ``fit_range``: sparsities ``(low, high)`` with ``0 <= low < high <= 1``."""
    try:
        low, high = (float(x) for x in fit_range)
    except (TypeError, ValueError):
        raise ValueError(f"fit_range must be (low, high) with 0 <= low < high <= 1; got {fit_range!r}.") from None
    if not 0.0 <= low < high <= 1.0:
        raise ValueError(f"fit_range must be (low, high) with 0 <= low < high <= 1; got {fit_range!r}.")
    return low, high


def _check_range(name: str, value: Any, lo: float, hi: float | None, hi_open: bool = False) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ControlTypeError(f"{name} must be a number; got {value!r} ({type(value).__name__}).")
    v = float(value)
    if not math.isfinite(v) or v < lo or (hi is not None and (v >= hi if hi_open else v > hi)):
        allowed = f"in [{lo}, {hi}{')' if hi_open else ']'}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be finite and {allowed}; got {value!r}.")
    return v


def check_curve(where: str, a: float, b: float) -> None:
    """The factor ``a * exp(b * target_sparsity)`` must be finite and > 0 for every target_sparsity in [0, 1]."""
    if a <= 0.0:
        raise ValueError(f"{where}: a must be > 0; got {a!r}.")
    if math.log(a) + max(b, 0.0) >= math.log(_FLOAT32_MAX):
        raise ValueError(
            f"{where}: a * exp(b * target_sparsity) overflows for target_sparsity in [0, 1] "
            f"(a={a!r}, b={b!r}); a calibrated curve gives factors of the order of the sequence length."
        )
    if a * math.exp(min(b, 0.0)) == 0.0:
        raise ValueError(f"{where}: a * exp(b * target_sparsity) underflows to 0 at target_sparsity=1 (a={a!r}, b={b!r}).")


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
        _check_range("skip_softmax_threshold", self.threshold, 0.0, 1.0, hi_open=True)
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
        if self.a is not None:
            check_curve("calibration", self.a, self.b)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any] | None) -> "SkipSoftmaxConfig":
        """Build from vLLM-Omni style ``backend_kwargs`` (unknown keys are ignored here)."""
        kw = kwargs or {}
        dut = kw.get("disabled_until_timestep")
        return cls(
            threshold=kw.get("skip_softmax_threshold"),
            target_sparsity=kw.get("target_sparsity"),
            disabled_until_timestep=0.0 if dut is None else dut,
        )

    @classmethod
    def coerce(cls, skip: Any, name: str = "skip") -> "SkipSoftmaxConfig | None":
        """``skip`` in any accepted form (module docstring) as a config; None stays None."""
        if skip is None or isinstance(skip, SkipSoftmaxConfig):
            return skip
        if isinstance(skip, (int, float)) and not isinstance(skip, bool):
            return cls(threshold=skip)
        if not isinstance(skip, Mapping):
            raise ControlTypeError(
                f"{name} must be a SkipSoftmaxConfig, a threshold in [0, 1), a dict "
                f"({{'threshold': 0.05, 'disabled_until_timestep': 0.9}}) or None; got {skip!r} ({type(skip).__name__})."
            )
        kw = dict(skip)
        if "skip_softmax_threshold" in kw:
            if "threshold" in kw:
                raise ValueError(f"{name} sets both 'threshold' and 'skip_softmax_threshold'; pass one.")
            kw["threshold"] = kw.pop("skip_softmax_threshold")
        allowed = ("threshold", "skip_softmax_threshold", "target_sparsity", "disabled_until_timestep")
        unknown = set(kw) - set(allowed)
        if unknown:
            raise ValueError(unknown_keys_message(name, unknown, allowed))
        if kw.get("disabled_until_timestep") is None:
            kw.pop("disabled_until_timestep", None)
        return cls(**kw)

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
    #: None: the route's block (``with_k_block``).
    k_block_size: int | None = None
    #: Take K's per-(head, channel) mean off before quantizing (softmax is unchanged by it; SageAttention's default).
    smooth_k: bool = True
    #: Split each K block into four scales, one per lane of a Hopper MMA quad: key ``j`` of a block takes
    #: scale ``(j % 8) // 2`` of it (SageAttention2's ``per_thread``; docs/design.md, "K scales per thread").
    #: None: the route's choice (``with_k_block``).
    k_per_thread: bool | None = None

    def __post_init__(self) -> None:
        if self.dtype_qk is not None:
            object.__setattr__(self, "dtype_qk", _dtype_name(self.dtype_qk))
        for field, sizes in (("q_block_size", BLOCK_SIZES), ("k_block_size", K_BLOCK_SIZES)):
            value = getattr(self, field)
            if field == "k_block_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value not in sizes:
                unset = " or None (the route's)" if field == "k_block_size" else ""
                raise ValueError(f"quant.{field} must be one of {sizes}{unset}; got {value!r}.")
        if not isinstance(self.smooth_k, bool):
            raise ValueError(f"quant.smooth_k must be True or False; got {self.smooth_k!r}.")
        if self.k_per_thread is not None and not isinstance(self.k_per_thread, bool):
            raise ValueError(f"quant.k_per_thread must be True, False or None (the route's); got {self.k_per_thread!r}.")
        if self.k_per_thread and self.k_block_size not in (None, *K_PER_THREAD_BLOCKS):
            raise ValueError(f"quant.k_per_thread splits K blocks of {K_PER_THREAD_BLOCKS} keys; got "
                             f"k_block_size={self.k_block_size}. Use one of those, or k_per_thread=False.")

    @classmethod
    def from_kwargs(cls, quant: Any) -> "QuantConfig":
        """Build from ``quant`` in any accepted form (module docstring); unknown keys raise."""
        if isinstance(quant, QuantConfig):
            return quant
        if quant is None:
            return cls()
        if isinstance(quant, str) or _is_torch_dtype(quant):
            return cls(dtype_qk=quant)
        if not isinstance(quant, Mapping):
            raise ControlTypeError(
                "quant must be a dict ({'dtype_qk': 'int8', 'k_block_size': 16}), a dtype name "
                f"({', '.join(map(repr, QK_QUANT_DTYPES))}), a QuantConfig or None; got {quant!r} ({type(quant).__name__})."
            )
        q = dict(quant)
        allowed = ("dtype_qk", "q_block_size", "k_block_size", "k_per_thread", "smooth_k")
        unknown = set(q) - set(allowed)
        if unknown:
            raise ValueError(unknown_keys_message("quant", unknown, allowed))
        return cls(
            dtype_qk=q.get("dtype_qk"),
            q_block_size=q.get("q_block_size", 1),
            k_block_size=q.get("k_block_size"),
            smooth_k=q.get("smooth_k", True),
            k_per_thread=q.get("k_per_thread"),
        )

    @classmethod
    def coerce(cls, quant: Any) -> "QuantConfig | None":
        """``quant`` in any accepted form as a config, or None when SAGE is off."""
        config = cls.from_kwargs(quant)
        return config if config.enabled else None

    @property
    def enabled(self) -> bool:
        return self.dtype_qk is not None

    def with_k_block(self, block: int, per_thread: bool = False) -> "QuantConfig":
        """This config with the K scales left to the route set: ``k_block_size`` to ``block``, ``k_per_thread``
        to ``per_thread`` (where the block it ends with can be split, else False)."""
        size = self.k_block_size if self.k_block_size is not None else block
        split = self.k_per_thread if self.k_per_thread is not None else per_thread and size in K_PER_THREAD_BLOCKS
        if size == self.k_block_size and split == self.k_per_thread:
            return self  # nothing left to the route (a call's config, every call): no new config to build and check
        return replace(self, k_block_size=size, k_per_thread=split)

    @property
    def qk_dtype(self) -> "torch.dtype":
        import torch

        if self.dtype_qk is None:
            raise ValueError("quant.dtype_qk is not set; SAGE is off.")
        return getattr(torch, QK_QUANT_DTYPES[self.dtype_qk])

    @property
    def qk_max(self) -> float:
        """Largest magnitude of the quantized Q/K grid (``M`` in docs/design.md, SAGE quantization)."""
        return 127.0 if self.dtype_qk == "int8" else 448.0
