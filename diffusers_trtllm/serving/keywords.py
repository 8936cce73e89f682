"""The keywords a layer's stock processor gets: what its attention module would pass it without us.

Flux's attention module, sixteen other transformer modules and the old ``Attention`` class pass a
keyword on to their processor only if the processor's ``__call__`` names it (``inspect.signature``,
every call), and drop the rest, most with a warning. Ours names every keyword of any stock processor
(``processor._define_call``: Flux then compiles with ``fullgraph=True``), so such a module hands ours
keywords its stock processor never gets: Flux's ``ip_hidden_states`` reaches the single-stream
blocks, whose ``FluxAttnProcessor`` does not take it. :class:`KeywordFilter` applies the module's own
rule with the stock processor's names instead of ours, and says what it drops as the module does
(its logger, its words, its quiet names). Modules that pass every keyword keep doing so.
"""

from __future__ import annotations

import inspect
import logging
import sys
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["KeywordFilter", "accepted_keywords", "keyword_filter"]

#: Stock processor class -> the names its ``__call__``'s signature gives (what a filtering module keeps).
_ACCEPTED: dict[type, frozenset[str]] = {}
#: (attention module class, stock processor class) -> the filter of that pair (None: the module filters nothing).
_FILTERS: dict[tuple[type, type], Optional["KeywordFilter"]] = {}


def accepted_keywords(processor_cls: type) -> frozenset[str]:
    """The parameter names of ``processor_cls.__call__``, as a filtering module reads them from an instance."""
    names = _ACCEPTED.get(processor_cls)
    if names is None:
        try:
            names = frozenset(inspect.signature(processor_cls.__call__).parameters) - {"self"}
        except (TypeError, ValueError):  # no signature to read: the module's filter would fail the same way
            names = frozenset()
        _ACCEPTED[processor_cls] = names
    return names


@dataclass(frozen=True)
class KeywordFilter:
    """An attention module's keyword rule, applied for its stock processor."""

    accepted: frozenset[str]
    #: Who the warning names, and what the module calls the keywords it drops (``joint_attention_kwargs``).
    processor_name: str
    kwargs_name: str
    #: Names the module drops without a word (Flux's ``ip_hidden_states``), and its logger (None: it never warns).
    quiet: frozenset[str]
    logger: Optional[logging.Logger]

    def apply(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` without what the stock processor's signature does not name; the module's warning for those
        it would have warned about."""
        dropped = [name for name in kwargs if name not in self.accepted]
        if not dropped:
            return kwargs
        said = [name for name in dropped if name not in self.quiet]
        if said and self.logger is not None:
            self.logger.warning(f"{self.kwargs_name} {said} are not expected by {self.processor_name} and will be "
                                "ignored.")
        return {name: value for name, value in kwargs.items() if name in self.accepted}


def keyword_filter(module_cls: type, processor_cls: type) -> Optional[KeywordFilter]:
    """The keyword rule of ``module_cls`` for a stock ``processor_cls``, or None when the module filters nothing.

    Read from the code of the module's ``forward``: it filters if it reads a signature, warns if it calls a
    logger's ``warning``; its words for the dropped keywords are the string that starts its message
    (``"joint_attention_kwargs "``) and its quiet names are the other names it spells.
    """
    key = (module_cls, processor_cls)
    if key not in _FILTERS:
        _FILTERS[key] = _read_filter(module_cls, processor_cls)
    return _FILTERS[key]


def _read_filter(module_cls: type, processor_cls: type) -> Optional[KeywordFilter]:
    code = getattr(getattr(module_cls, "forward", None), "__code__", None)
    if code is None or "signature" not in code.co_names:
        return None
    strings = [c for c in code.co_consts if isinstance(c, str)]
    kwargs_name = next((s.strip() for s in strings if s.endswith("kwargs ")), "attention kwargs")
    module = sys.modules.get(module_cls.__module__)
    logger = getattr(module, "logger", None) if "warning" in code.co_names else None
    return KeywordFilter(
        accepted=accepted_keywords(processor_cls),
        processor_name=processor_cls.__name__,
        kwargs_name=kwargs_name,
        quiet=frozenset(s for s in strings if s.isidentifier()),
        logger=logger if isinstance(logger, logging.Logger) else None,
    )
