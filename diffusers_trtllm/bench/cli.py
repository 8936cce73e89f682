"""Argument helpers shared by the benchmarks' command lines (attention and end to end)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

__all__ = ["floats", "names", "add_common_args"]


def floats(text: str) -> tuple[float, ...]:
    """``"0.01,0.05"`` -> ``(0.01, 0.05)``; ``""`` -> ``()``."""
    return tuple(float(x) for x in text.split(",") if x.strip())


def names(text: str) -> tuple[str, ...]:
    """``"a, b"`` -> ``("a", "b")``."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_common_args(p: argparse.ArgumentParser, default_name: str, outputs: str) -> None:
    """``--out``, ``--name``, ``--device``, ``--dtype``, ``--seed``."""
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    p.add_argument("--name", default=default_name, help=f"file stem of the outputs ({outputs})")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
