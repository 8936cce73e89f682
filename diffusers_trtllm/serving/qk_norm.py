"""Diffusers' ``RMSNorm`` as one launch of ours while one of our layers runs its stock processor.

Qwen-Image's, SD3.5's and HunyuanVideo's processors normalize Q and K with Diffusers' ``RMSNorm``
(``attn.norm_q(query)``, ...), which eager torch runs as six launches through float32 intermediates
(:mod:`diffusers_trtllm.kernels.rms_norm`). While a processor with ``fused_qk_norm`` on serves a layer,
``RMSNorm.forward`` is rebound (once, and put back with the module globals when no layer of ours is left:
``intercept.restore_globals``) to a forward that runs the one-launch kernel only in a thread running such a layer's
stock processor (``intercept._CALL.layer``) whose role is not left ``"stock"``, in plain eager execution, for
``RMSNorm`` itself (a subclass may normalize otherwise) without a bias, on a CUDA tensor. Everything else runs
Diffusers' own forward: a stock model in any thread, the CPU, ``torch.compile`` (Inductor fuses it), layouts the
kernel does not take.
Flux, Flux.2, Wan and LTX-Video use ``torch.nn.RMSNorm``, which torch already runs as one launch on CUDA.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..kernels.rms_norm import fused_rms_norm, fused_rms_norm_reasons
from . import intercept

__all__ = ["RMS_NORM", "fuse_rms_norm", "takes_norms_of"]

#: The class whose ``forward`` is rebound, as ``intercept.rebind`` names it.
RMS_NORM = "diffusers.models.normalization:RMSNorm"


def _fused_forward(cls: type, original: Callable) -> Callable:
    def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        state = getattr(intercept._CALL, "layer", None)
        if (state is not None and state.fused_qk_norm and type(self) is cls and self.bias is None
                and state.settings().mode != "stock" and intercept._eager()
                and not fused_rms_norm_reasons(hidden_states, self.weight)):
            return fused_rms_norm(hidden_states, self.weight, self.eps)
        return original(self, hidden_states)

    forward._trtllm_original = original  # type: ignore[attr-defined]
    return forward


def fuse_rms_norm() -> None:
    """Rebind ``RMSNorm.forward`` (once) so that our layers' stock processors normalize in one launch."""
    from diffusers.models.normalization import RMSNorm

    if not hasattr(RMSNorm.forward, "_trtllm_original"):
        intercept.rebind(RMS_NORM, "forward", _fused_forward(RMSNorm, RMSNorm.forward))


def takes_norms_of(module: torch.nn.Module) -> bool:
    """Whether ``module`` (an attention module) holds a Diffusers ``RMSNorm`` whose forward we take over; if so,
    ``RMSNorm.forward`` is rebound now."""
    from diffusers.models.normalization import RMSNorm

    if not any(type(child) is RMSNorm for child in module.children()):
        return False
    fuse_rms_norm()
    return True
