"""Which Triton the interpreter tests can run on, read from the installed version without importing it (the children
import it under ``TRITON_INTERPRET=1``). torch's CUDA wheels pin their own Triton (torch 2.13: 3.7.1), which the test
extra accepts, so the suite meets older interpreters than the one it was written against."""

from __future__ import annotations

import re
from importlib import metadata


def _version() -> tuple[str, tuple[int, int]] | None:
    try:
        text = metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None
    major, minor = (int(x) for x in re.findall(r"\d+", text)[:2])
    return text, (major, minor)


def interpreter_missing() -> str | None:
    """Why Triton's interpreter cannot run the kernels here (None: it can)."""
    found = _version()
    if found is None:
        return "triton is not installed"
    text, version = found
    if version < (3, 7):
        return f"triton {text}'s interpreter fails under NumPy 2 (int() of a one-element array); it needs 3.7 or later"
    return None


def fma_missing() -> str | None:
    """Why the interpreter's ``tl.fma`` is not a fused multiply-add here (None: it rounds once, as the GPU's does)."""
    found = _version()
    if found is not None and found[1] < (3, 8):
        return f"triton {found[0]}'s interpreter rounds tl.fma twice (3.8 and later round once, as the GPU does)"
    return interpreter_missing()
