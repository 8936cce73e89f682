"""IP-Adapters: the adapter's processor keeps its layer, and our kernels serve the layer's own attention in it.

Diffusers' IP-Adapter code finds its processors by class among ``attn_processors``
(``set_ip_adapter_scale``, ``unload_ip_adapter``, SD3's ``is_ip_adapter_active``), and each holds the
adapter's weights as its attention module's ``processor`` child (moved by ``.to()`` and offloading,
saved by ``state_dict()``). So where ``load_ip_adapter`` puts one on a layer we serve, or ``install``
finds one, it stays the module's processor (``serving.setters``, ``serving.install``), and two hooks on
the module name our layer as this thread's call around the module's forward, as our processor's call
does for the other layers (``intercept.enter_call``). The adapter's first attention call is the
layer's own (latents and text) and is served; those after it attend to the image prompt's tokens and
run stock, said in the step table (``intercept.is_ip_adapter``, ``intercept._image_prompt_call``).
When the adapter's processor is replaced (``unload_ip_adapter``), the new one goes under ours again.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from . import intercept
from .layer import layer_of

__all__ = ["serve_in_place", "stop_serving_in_place"]

#: Per thread: (module, what its hooked forward found) for each one in flight, innermost last.
_IN_FLIGHT = threading.local()


def _saved() -> list:
    stack = getattr(_IN_FLIGHT, "saved", None)
    if stack is None:
        stack = _IN_FLIGHT.saved = []
    return stack


def _before_forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    state = layer_of(module)
    if state is not None and state.in_place and state.mode is not None:
        _saved().append((module, intercept.enter_call(state, args, kwargs)))


def _after_forward(module: torch.nn.Module, args: tuple, output: Any) -> None:
    """Also called when the forward raised (``always_call``): puts back only what this module's call took."""
    stack = _saved()
    if stack and stack[-1][0] is module:
        intercept.exit_call(stack.pop()[1])


def serve_in_place(module: torch.nn.Module) -> None:
    """Hook ``module`` (once) so that its forward runs as a call of the layer of ours it holds."""
    if _before_forward not in module._forward_pre_hooks.values():
        module.register_forward_pre_hook(_before_forward, with_kwargs=True)
        module.register_forward_hook(_after_forward, always_call=True)


def stop_serving_in_place(module: torch.nn.Module) -> None:
    """Take our hooks off ``module`` (nothing if it has none)."""
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key in [k for k, hook in hooks.items() if hook in (_before_forward, _after_forward)]:
            del hooks[key]
            for extra in (module._forward_pre_hooks_with_kwargs, module._forward_hooks_always_called):
                extra.pop(key, None)
