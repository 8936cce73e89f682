"""Library logger and warnings issued once per cause.

The logger is a child of Diffusers' library logger (``diffusers.trtllm``), made with
``diffusers.utils.logging.get_logger``: Diffusers' verbosity controls ours
(``diffusers.utils.logging.set_verbosity_error()`` silences our warnings too) and our
messages come out through its handler, formatted like its own.
"""

from __future__ import annotations

import logging
from typing import Hashable


class _NoTorchvisionFallbackNote(logging.Filter):
    """Drops transformers' note that an image processor falls back to PIL without torchvision: Diffusers'
    imports print it at every start, and nothing here uses an image processor (the fallback still happens)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed)" not in record.getMessage()


# Before Diffusers (and through it transformers) is imported below.
logging.getLogger("transformers.utils.import_utils").addFilter(_NoTorchvisionFallbackNote())

from diffusers.utils import logging as diffusers_logging  # noqa: E402

#: Under ``diffusers`` so that Diffusers' ``set_verbosity_*`` applies.
LOGGER_NAME = "diffusers.trtllm"
logger = diffusers_logging.get_logger(LOGGER_NAME)
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
