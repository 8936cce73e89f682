"""Serving Diffusers: the processor, its per-layer state, install/uninstall, the interception of attention calls.

- :mod:`.processor`: ``TrtllmAttnProcessor``, settings per role and layer.
- :mod:`.layer`: the per-layer state on each attention module, serving one call.
- :mod:`.install`: ``install(target, proc)`` / ``uninstall(target)``.
- :mod:`.setters`: Diffusers' wrapped processor setters, restored once no layer of ours is alive.
- :mod:`.intercept`: the custom ops and the rebound ``dispatch_attention_fn`` / ``F``.
- :mod:`.keywords`: the keywords a stock processor gets (its attention module's own rule).
- :mod:`.ip_adapter`: an IP-Adapter's processor keeps its layer; hooks on the module serve it there.
- :mod:`.parallel`: which context-parallel calls are served.
- :mod:`.roles`: a layer's role from its structure and first call.
- :mod:`.modules`: a pipeline's denoisers (the one rule every entry point uses).
- :mod:`.timestep`: the denoising timestep of each transformer's layers.

See docs/design.md.
"""

from .install import install, uninstall

__all__ = ["install", "uninstall"]
