"""Which Triton the interpreter tests can run on, read from the installed version without importing it (the children
import it under ``TRITON_INTERPRET=1``). torch's CUDA wheels pin their own Triton (torch 2.13: 3.7.1), which the test
extra accepts, so the suite meets older interpreters than the one it was written against."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


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


def interpreted(child: str, count: int, timeout: int = 120) -> list:
    """The ``count`` cases ``child`` (Python source whose last line of output is a JSON list) prints, run under
    Triton's interpreter in a child process (``TRITON_INTERPRET`` is read at import) with the repository and the tests
    on its path; the test is skipped where the interpreter cannot run."""
    missing = interpreter_missing()
    if missing:
        pytest.skip(missing)
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=timeout,
                         env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path))
    assert run.returncode == 0, run.stderr[-3000:]
    cases = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(cases) == count, cases
    return cases


def compiled_for(kernel, args: tuple, constexprs: dict, sm: int = 90, **options):
    """``kernel`` through Triton's whole GPU pipeline for ``sm`` without a GPU, specialized as a launch with ``args``
    is (tensors and nonzero integers divisible by 16 marked so); the test is skipped where this Triton has no CUDA
    backend."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    signature = {name: mangle_type(arg) for name, arg in zip(kernel.arg_names, args)}
    signature.update({name: "constexpr" for name in constexprs})
    aligned = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(args)
               if isinstance(arg, torch.Tensor) or (isinstance(arg, int) and arg and arg % 16 == 0)}
    try:
        return triton.compile(ASTSource(kernel, signature, constexprs, aligned), target=GPUTarget("cuda", sm, 32),
                              options=options)
    except Exception as exc:  # a Triton without the CUDA backend, not a kernel bug
        if "backend" in str(exc).lower() and "cuda" in str(exc).lower():
            pytest.skip(f"this Triton cannot compile for CUDA: {exc}")
        raise
