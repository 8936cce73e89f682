"""Fitting into Diffusers: install/uninstall, the interception of attention calls, roles.

- :mod:`.installation`: ``install(target, proc)`` / ``uninstall(target)`` and the wrapped
  processor setters that make ``set_attn_processor(proc)`` work.
- :mod:`.intercept`: the custom op and the rebound ``dispatch_attention_fn`` / ``F``.
- :mod:`.roles`: a layer's role from its structure and first call.

See docs/design.md.
"""

from .installation import install, uninstall

__all__ = ["install", "uninstall"]
