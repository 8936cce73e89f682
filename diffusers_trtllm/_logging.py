"""Library logger and warnings issued once per cause."""

from __future__ import annotations

import logging
from typing import Hashable

logger = logging.getLogger("diffusers_trtllm")
_warned: set[Hashable] = set()


def warn_once(cause: Hashable, message: str, *args: object) -> None:
    """Log ``message`` at WARNING the first time ``cause`` is seen in this process."""
    if cause in _warned:
        return
    _warned.add(cause)
    logger.warning(message, *args)


def info_once(cause: Hashable, message: str, *args: object) -> None:
    if cause in _warned:
        return
    _warned.add(cause)
    logger.info(message, *args)
