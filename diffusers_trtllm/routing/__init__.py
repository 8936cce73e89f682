"""Which kernel route runs an attention call.

- :mod:`.registry`: the call at the kernel boundary, its result, route capabilities, the registry.
- :mod:`.order`: the ranked list of routes for a call (one function), the choice, ``NoRouteError``.
- :mod:`.policy`: the never-slower rules that drop skip-softmax / SAGE where they cannot pay off.

Every measured constant the order and the rules use is defined in these two modules, citing the
results file under ``benchmarks/results/`` it came from. See docs/design.md.
"""

from .order import NoRouteError, ranked_routes, select_route
from .registry import (AttentionCall, AttentionResult, Capabilities, Route, device_sm, get_route, register_route,
                       registered_routes, route_names)

__all__ = ["AttentionCall", "AttentionResult", "Capabilities", "Route", "register_route", "get_route", "route_names",
           "registered_routes", "device_sm", "ranked_routes", "select_route", "NoRouteError"]
