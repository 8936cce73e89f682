"""FlashInfer plumbing shared by the routes that call it (``trtllm-gen``, ``fmha-v2``, ``fa3``).

FlashInfer is optional: ``flashinfer_or_none`` imports it once, guarded, and
``flashinfer_missing_reason`` says why a route cannot use it. Its kernels take a
workspace buffer; one zero-initialised buffer per device serves every route
(the TRT-LLM kernels keep counters there that they reset to zero themselves;
FA3's ragged planner writes only to its own integer buffers). Many kernels are
compiled by JIT on first use: ``jit_missing_reason`` and ``announce_jit`` tell
the user before the ~80 s build, or why it cannot happen (no ``nvcc``).
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

from .._logging import warn_once

__all__ = [
    "flashinfer_or_none",
    "flashinfer_missing_reason",
    "flashinfer_workspace",
    "nvcc_path",
    "jit_built",
    "jit_missing_reason",
    "announce_jit",
]

#: Workspace size FlashInfer's own tests and examples use.
DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024

_workspaces: dict[torch.device, torch.Tensor] = {}
#: Modules seen compiled (checked on every call's route selection, so remembered).
_built: set[str] = set()


@functools.lru_cache(maxsize=None)
def _import() -> tuple[ModuleType | None, str | None]:
    try:
        return importlib.import_module("flashinfer"), None
    except Exception as err:  # ImportError, or a broken install raising anything
        return None, f"{type(err).__name__}: {err}"


def flashinfer_or_none() -> ModuleType | None:
    """The ``flashinfer`` module, or None when it is not installed or fails to import."""
    return _import()[0]


def flashinfer_missing_reason() -> str | None:
    """Why FlashInfer cannot be used (for a route's reasons), or None when it imports."""
    error = _import()[1]
    if error is None:
        return None
    return f"flashinfer is not installed or failed to import ({error}); pip install 'diffusers-trtllm[flashinfer]'"


def flashinfer_workspace(device: torch.device | str, min_bytes: int = DEFAULT_WORKSPACE_BYTES) -> torch.Tensor:
    """One zero-initialised ``uint8`` workspace per device, grown (and re-zeroed) when a caller needs more."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ws = _workspaces.get(device)
    if ws is None or ws.numel() < min_bytes:
        ws = torch.zeros(max(min_bytes, DEFAULT_WORKSPACE_BYTES), dtype=torch.uint8, device=device)
        _workspaces[device] = ws
    return ws


def nvcc_path() -> str | None:
    """The CUDA compiler FlashInfer's JIT would use (``CUDA_HOME``/``CUDA_PATH``, then ``PATH``)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def jit_built(uri: str) -> bool:
    """Whether FlashInfer already holds a compiled module ``uri`` (JIT cache or AOT package)."""
    if uri in _built:
        return True
    if flashinfer_or_none() is None:
        return False
    try:
        env = importlib.import_module("flashinfer.jit.env")
        found = (env.FLASHINFER_JIT_DIR / uri / f"{uri}.so").exists() or bool(env.get_aot_artifacts(uri))
    except Exception:  # internals moved: assume a build may be needed
        return False
    if found:
        _built.add(uri)
    return found


def jit_missing_reason(uri: str) -> str | None:
    """Reason a route cannot run: module ``uri`` must be JIT-built and no ``nvcc`` is found."""
    if jit_built(uri) or nvcc_path() is not None:
        return None
    return (
        f"FlashInfer must JIT-build kernel {uri} on first use and no nvcc was found "
        "(install the CUDA toolkit, put nvcc on PATH or set CUDA_HOME)"
    )


def announce_jit(uri: str, seconds: int = 80) -> None:
    """Tell the user, once per module, that the next call compiles a FlashInfer kernel."""
    if jit_built(uri):
        return
    where = ""
    try:
        where = f"; cached under {importlib.import_module('flashinfer.jit.env').FLASHINFER_JIT_DIR}"
    except Exception:
        pass
    warn_once(("flashinfer-jit", uri), "building FlashInfer kernel %s by JIT, about %d s, once%s", uri, seconds, where)
