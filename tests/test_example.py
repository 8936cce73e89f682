"""The example generation and calibration (CLI) and the quickstart notebook run offline on the CPU."""

from __future__ import annotations

import json
import os
import time

import pytest

from diffusers_trtllm.__main__ import DEFAULT_GATE, DEFAULT_THRESHOLD, main, parse_args, run_demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_runs_and_saves_comparison(tmp_path, capsys):
    start = time.perf_counter()
    results = run_demo(parse_args(["--steps", "4", "--out", str(tmp_path), "--disabled-until-timestep", "0.7"]))
    assert time.perf_counter() - start < 60
    assert os.path.isfile(tmp_path / "comparison.png")
    dense, skip, sage = (results[k]["table"] for k in ("dense", "skip-softmax", "skip + SAGE int8"))
    assert [r["mode"] for r in dense] == ["dense"] * 4 and {r["routes"] for r in dense} == {"sdpa"}
    # disabled_until_timestep=0.7 over t = 1, .75, .5, .25: the first two dense (gated), then sparse.
    assert [r["mode"] for r in skip] == ["dense", "dense", "sparse", "sparse"]
    assert [r["gated"] for r in skip] == [True, True, False, False]
    assert results["skip-softmax"]["skipped"] > 0.2  # the tiny pipeline's attention is local: tiles are skipped
    assert all(r["sage"] and r["sage_dtype"] == "int8" for r in sage)
    out = capsys.readouterr().out
    assert "difference vs dense" in out and "RANDOM WEIGHTS" in out and "dense (gated)" in out
    assert "single_transformer_blocks.0.attn (self)" in out  # the per-layer summary


def test_cli_entry_point(tmp_path, capsys):
    main(["--steps", "2", "--out", str(tmp_path), "--quant", "fp8_e4m3", "--threshold", "0.1", "--height", "32",
          "--width", "48"])
    out = capsys.readouterr().out
    assert "skip + SAGE fp8_e4m3" in out and "384 image tokens" in out


def test_offline_calibrate_then_demo_with_that_calibration(tmp_path, capsys):
    path = tmp_path / "calib.json"
    main(["calibrate", "--out", str(path), "--steps", "4", "--target-sparsity", "0.3"])
    config = json.loads(path.read_text())
    assert config["sparse_attention_config"]["config_groups"]["group_0"]["target_sparsity"] == 0.3
    results = run_demo(parse_args(["--steps", "4", "--out", str(tmp_path), "--target-sparsity", "0.3",
                                   "--calibration", str(path), "--disabled-until-timestep", "0"]))
    assert abs(results["skip-softmax"]["skipped"] - 0.3) < 0.08
    assert "calibrating the tiny pipeline first" not in capsys.readouterr().out


def test_target_sparsity_offline_calibrates_on_the_fly(tmp_path, capsys):
    run_demo(parse_args(["--steps", "2", "--out", str(tmp_path), "--target-sparsity", "0.3"]))
    assert "calibrating the tiny pipeline first" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "a cat"], "--prompt needs --model"),
    (["--height", "40"], "multiple of 16"),
    (["--calibration", "README.md"], "pass --target-sparsity too"),
    (["calibrate", "--prompts", "p.txt"], "--prompts needs --model"),
    (["calibrate", "--model", "some/model"], "--model needs --prompts"),
])
def test_flags_that_cannot_work_offline_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_help_shows_the_defaults_the_readme_quotes(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"(default: {DEFAULT_THRESHOLD})" in out and f"(default: {DEFAULT_GATE})" in out
    guide = open(os.path.join(ROOT, "docs", "usage.md")).read()  # its "Command line" section
    assert f"--threshold {DEFAULT_THRESHOLD}" in guide and f"--disabled-until-timestep {DEFAULT_GATE}" in guide


def test_quickstart_notebook_executes(monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(os.path.join(ROOT, "examples", "quickstart.ipynb"), as_version=4)
    env_path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", ROOT + (os.pathsep + env_path if env_path else ""))  # the kernel's import path
    # 17-19 s on 2 cores, 49 s beside the suite's background build and another run: the limits guard a hang.
    start = time.perf_counter()
    nbclient.NotebookClient(notebook, timeout=150, kernel_name="python3",
                            resources={"metadata": {"path": ROOT}}).execute()
    assert time.perf_counter() - start < 150
    outputs = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "max |dense - stock| = 0.0" in outputs
    assert "sparse" in outputs


def _readme() -> str:
    return open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def test_readme_cpu_example_gates_then_skips():
    """The README's CPU example with the one line: dense (gated) on the early steps, sparse after."""
    section = _readme().split("## On a CPU", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    table = namespace["proc"].format_step_table()
    assert "dense (gated)" in table and "sparse" in table and "int8" in table


def test_readme_is_a_five_minute_page_and_its_links_resolve():
    import re

    readme = _readme()
    lines = readme.splitlines()
    assert len(lines) <= 150
    first_screen = "\n".join(lines[:45])
    for needed in ("random weights", "H100", "H200", "not run on hardware", "| vs stock |"):
        assert needed in first_screen, needed
    for needed in ("bash scripts/setup.sh && .venv/bin/python -m diffusers_trtllm",
                   "bash scripts/setup.sh && bash scripts/test.sh", 'backend="reference"', "fused_rotary",
                   "set_attn_processor", "https://download.pytorch.org/whl/cpu", "docs/model_card.md"):
        assert needed in readme, needed
    table = [line for line in readme.split("## What to expect", 1)[1].split("\n\n**Caveats**", 1)[0].splitlines()
             if line.startswith("| ") and not line.startswith("| model")]
    assert 0 < len(table) <= 8
    for row in table:  # one figure per cell, and its result file
        assert "](benchmarks/results/" in row and ";" not in row and " / " not in row, row
    for document in (readme, open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8").read()):
        assert not re.search(r"\b(issue \d+|session|round of work|our target|project's own targets)\b", document)
    assert len(open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8").read().splitlines()) <= 500
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert "scripts/setup.sh" in ci and "scripts/test.sh" in ci  # the README's test command is CI's
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert any(link.startswith("benchmarks/results/") for link in links)
    for link in links:
        assert os.path.exists(os.path.join(ROOT, link)), link


def test_model_card_names_the_routes_the_route_table_names():
    import re

    from diffusers_trtllm.config import ROUTE_NAMES

    card = open(os.path.join(ROOT, "docs", "model_card.md"), encoding="utf-8").read()
    performance = open(os.path.join(ROOT, "docs", "performance.md"), encoding="utf-8").read()
    table = performance.split("## Kernel routes and GPU support", 1)[1].split("\n## ", 1)[0]
    named = {name for name in re.findall(r"`([a-z0-9-]+)`", card) if name in ROUTE_NAMES}
    assert {"gluon", "triton", "sage-sm90"} <= named
    for name in named:
        assert f"| `{name}`" in table, name
