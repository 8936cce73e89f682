"""The reports of ``benchmarks/profile_e2e.py``, ``power_probe.py``, ``e2e_attention_probe.py`` and ``bench_rotary.py`` (their GPU parts
run on the device; what the results keep is built here from fixed numbers)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_forward_profile_lists_each_setting_and_what_moved_against_stock():
    profile_e2e = _script("profile_e2e")
    result = {"gpu": "G", "torch": "T", "command": "c", "settings": {
        "stock": {"wall_ms": 100.0, "kernel_ms": 99.0, "kernels": {"sdpa": (2, 60.0), "gemm": (4, 39.0)}},
        "sage-int8": {"wall_ms": 80.0, "kernel_ms": 79.5, "kernels": {"sdpa": (1, 1.0), "gemm": (4, 39.2),
                                                                      "sage": (1, 39.0), "quant": (3, 0.3)}},
    }}
    text = profile_e2e.markdown(result, top=2)
    assert "## stock: forward 100.0 ms, kernels 99.0 ms (GPU idle 1.0 ms)" in text
    assert "| `sdpa` | 2 | 60.0 | 60.6% |" in text and "| `gemm` | 4 | 39.0 | 39.4% |" in text
    against = text.split("## sage-int8 against stock")[1]
    assert "| `sdpa` | 2 | 1 | -59.0 |" in against and "| `sage` | 0 | 1 | +39.0 |" in against
    assert "| `quant` | 0 | 3 | +0.3 |" in against  # launched only by ours: listed whatever its time
    assert "`gemm`" not in against  # the same launches, within 1 ms


def test_power_probe_names_the_sustained_rows_and_gives_each_call_its_energy():
    power_probe = _script("power_probe")
    rows = [{"gemms_before": b, "call": c, "ms": ms, "vs_cudnn": r, "sm_clock_mhz": 1500.0, "power_w": 700.0,
             "joules": 700.0 * ms / 1000} for b, c, ms, r in ((0, "cudnn", 40.0, 1.0), (power_probe.SUSTAINED, "ours", 20.0, 2.0))]
    text = power_probe.markdown({"gpu": "G", "torch": "T", "shape": "s", "command": "c", "rows": rows})
    assert "| 0 | cudnn | 40.00 | 1.000x | 1500 | 700 | 28.00 |" in text
    assert "| same call | ours | 20.00 | 2.000x | 1500 | 700 | 14.00 |" in text


def test_attention_probe_table_has_a_column_per_measure():
    probe = _script("e2e_attention_probe")
    text = probe.markdown({"gpu": "G", "command": "c", "inputs": {"e2e call": {"cudnn": 36.0, "skipped": 0.369},
                                                                 "bench": {"cudnn": 37.06, "skipped": 0.8622}}})
    assert "| input | cudnn | skipped |" in text
    assert "| e2e call | 36 | 0.369 |" in text and "| bench | 37.06 | 0.8622 |" in text


def test_rotary_bench_gives_the_saving_and_flags_a_mismatch():
    bench_rotary = _script("bench_rotary")
    row = {"shape": "wan_14b_480p", "tokens": 32760, "stock_processor_ms": 16.0, "stock_processor_without_rotary_ms": 10.0,
           "stock_rotary_ms": 6.0, "ours_ms": 0.5, "fused": True, "bit_equal": True}
    result = {"environment": {"gpu": "G", "torch": "T", "triton": "3", "diffusers": "D"}, "command": "c",
              "rows": [row, {**row, "shape": "other", "bit_equal": False}]}
    text = bench_rotary.markdown(result)
    assert "| wan_14b_480p | 32760 | 16.00 | 10.00 | 6.00 | 0.500 | 5.50 | yes |" in text
    assert "| other | 32760 | 16.00 | 10.00 | 6.00 | 0.500 | 5.50 | **no** |" in text
