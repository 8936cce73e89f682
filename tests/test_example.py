"""The example generation (CLI) and the quickstart notebook run offline on the CPU."""

from __future__ import annotations

import os
import time

import pytest

from diffusers_trtllm.__main__ import main, run_demo, parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_runs_and_saves_comparison(tmp_path, capsys):
    start = time.perf_counter()
    results = run_demo(parse_args(["--steps", "4", "--out", str(tmp_path)]))
    assert time.perf_counter() - start < 30
    assert os.path.isfile(tmp_path / "comparison.png")
    dense, skip, sage = (results[k]["table"] for k in ("dense", "skip-softmax", "skip + SAGE int8"))
    assert [r["mode"] for r in dense] == ["dense"] * 4 and {r["routes"] for r in dense} == {"sdpa"}
    # disabled_until_timestep=0.7 over t = 1, .75, .5, .25: the first two dense, then sparse.
    assert [r["mode"] for r in skip] == ["dense", "dense", "sparse", "sparse"]
    assert all(r["skipped_fraction"] > 0 for r in skip if r["mode"] == "sparse")
    assert all(r["sage"] for r in sage)
    out = capsys.readouterr().out
    assert "difference vs dense" in out and "skipped" in out


def test_cli_entry_point(tmp_path, capsys):
    main(["--steps", "2", "--out", str(tmp_path), "--quant", "fp8_e4m3", "--threshold", "0.1"])
    assert "skip + SAGE fp8_e4m3" in capsys.readouterr().out


def test_quickstart_notebook_executes(monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(os.path.join(ROOT, "examples", "quickstart.ipynb"), as_version=4)
    env_path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", ROOT + (os.pathsep + env_path if env_path else ""))  # the kernel's import path
    start = time.perf_counter()
    nbclient.NotebookClient(notebook, timeout=60, kernel_name="python3",
                            resources={"metadata": {"path": ROOT}}).execute()
    assert time.perf_counter() - start < 60
    outputs = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "max |dense - stock| = 0.0" in outputs
    assert "sparse" in outputs
