"""``benchmarks/ncu_hotspots.py``: the summary of an Nsight Compute source page that the results keep."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "ncu_hotspots", Path(__file__).resolve().parents[1] / "benchmarks" / "ncu_hotspots.py")
ncu_hotspots = sys.modules["ncu_hotspots"] = importlib.util.module_from_spec(_SPEC)  # (dataclasses look it up)
_SPEC.loader.exec_module(ncu_hotspots)

_HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_barrier",'
           '"stall_wait","stall_barrier (Not Issued)"')


def _page(tmp_path, *rows):
    path = tmp_path / "page.csv"
    path.write_text("\n".join(['==PROF== Connected to process 1', '"Kernel Name","k",', _HEADER, *rows]) + "\n")
    return str(path)


def test_rows_after_the_header_with_their_stall_reasons_and_not_the_not_issued_columns(tmp_path):
    page = _page(tmp_path, '"0x10","      BAR.SYNC 0x1","90","8","80","10","70"', '"0x20","  FADD R1, R2, R3","10","8","0","10","0"')
    first, second = ncu_hotspots.read_source_page(page)
    assert (first.index, first.sass, first.samples, first.executed) == (0, "BAR.SYNC 0x1", 90, 8)
    assert first.stalls == {"barrier": 80, "wait": 10} and second.stalls == {"wait": 10}
    text = ncu_hotspots.report([first, second], top=1)
    assert "100 warp-stall samples over 2 instructions" in text and "barrier 80.0%" in text
    assert "BAR.SYNC 0x1" in text and "FADD" not in text.split("instruction  (largest reasons)")[1]


def test_a_file_without_a_source_page_says_how_to_make_one(tmp_path):
    path = tmp_path / "raw.csv"
    path.write_text('"ID","Metric Name"\n')
    with pytest.raises(SystemExit, match="--page source --csv"):
        ncu_hotspots.read_source_page(str(path))
