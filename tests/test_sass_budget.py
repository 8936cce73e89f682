"""``benchmarks/sass_budget.py``: the main loop of a SASS listing, path by path."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "sass_budget", Path(__file__).resolve().parents[1] / "benchmarks" / "sass_budget.py")
sass_budget = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sass_budget)


def _listing(*instructions: str) -> list[tuple[int, str]]:
    return [(16 * i, text) for i, text in enumerate(instructions)]


def test_paths_take_both_ways_of_a_branch_inside_the_loop_and_neither_retry_nor_spin():
    """A conditional branch forward inside the loop splits the paths; a branch out of it (a barrier's retry) and one
    back inside it (a spin) count as not taken; the outer loop around it is not the main loop."""
    code = _listing(
        "MOV R1, R2",                                         # 0x00: the outer loop's head
        "IGMMA.64x128x32.S8.S8 R88, gdesc[UR4], RZ, !UPT",    # 0x10: the main loop's head
        "@P0 BRA 0x50",                                       # 0x20: skips the rescale
        "FMUL R24, R24, R9",                                  # 0x30
        "FMUL R25, R25, R9",                                  # 0x40
        "QGMMA.64x128x32.F32.E4M3.E4M3 R24, R168, gdesc[UR4], R24",  # 0x50
        "@!P1 BRA 0xb0",                                      # 0x60: retry, out of line
        "@P3 BRA 0x50",                                       # 0x70: spin, back inside the body
        "@P2 BRA 0x10",                                       # 0x80: the main loop's back-edge
        "@P4 BRA 0x0",                                        # 0x90: the outer loop's
        "EXIT",                                               # 0xa0
        "BRA 0x70",                                           # 0xb0: the retry's way back
    )
    assert sass_budget.main_loop(code, {address: i for i, (address, _) in enumerate(code)}) == (1, 8)
    rows = sass_budget.budget(code)
    assert [(r["total"], r["FMUL"], r["GMMA"]) for r in rows] == [(6, 0, 2), (8, 2, 2)]
