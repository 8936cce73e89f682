"""The command line checks every value before any model is built, answers fast, and says what went wrong in
one line (issue 20); ``tests/test_example.py`` runs its commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from diffusers_trtllm.__main__ import main, parse_args, parse_calibrate_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def no_model(monkeypatch):
    """Building a pipeline fails the test: every check must come first."""
    import diffusers_trtllm.demo as demo

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the arguments were checked")

    monkeypatch.setattr(demo, "build_demo_pipeline", refuse)


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, says", [
    (["--threshold", "0.1", "--target-sparsity", "0.3"], "exclusive"),
    (["--target-sparsity", "0.3", "--calibration", "README.md"], "could not be read as UTF-8 JSON"),
    (["--backend", "fa3"], "CUDA GPU"),
    (["--backend", "sdpa"], "--fallback dense"),  # sdpa has no skip-softmax: the demo's sparse runs would fail
    (["--out", "README.md"], "--out"),
    (["--out", "README.md/below"], "--out"),
    (["calibrate", "--tile", "0", "128"], "--tile"),
    (["calibrate", "--fit-range", "0.9", "0.1"], "--fit-range"),
    (["calibrate", "--out", "docs"], "no checkpoint"),
    (["calibrate", "--out", "README.md/calib.json"], "--out"),
    (["calibrate", "--height", "70"], "multiple of 16"),
    (["calibrate", "--model", "m", "--prompts", "no-such-file.txt"], "--prompts"),
])
def test_bad_values_stop_before_any_model_with_one_line(argv, says, capsys, no_model):
    assert says in _refused(argv, capsys)


def test_a_prompts_file_that_is_not_utf8_is_named_with_the_fix(tmp_path, capsys, no_model):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("un caf\xe9\n".encode("latin-1"))
    err = _refused(["calibrate", "--model", "m", "--prompts", str(prompts)], capsys)
    assert str(prompts) in err and "UTF-8" in err and "save it as UTF-8" in err


def test_a_failed_calibrate_run_leaves_no_empty_out_folder(tmp_path, monkeypatch, capsys):
    from diffusers_trtllm import calibration

    def fail(*args, **kwargs):
        raise RuntimeError("the run failed")

    monkeypatch.setattr(calibration, "calibrate", fail)
    out = tmp_path / "new" / "deeper" / "calib.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--num-prompts", "1", "--steps", "1", "--out", str(out)])
    assert "the run failed" in str(exit_info.value.code)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("content", [{"config_groups": {}}, {"sparse_attention_config": {"config_groups": {"g": {
    "algorithm": "skip_softmax", "threshold_scale_factor": {"formula": "a * b"}}}}}, [1, 2]])
def test_a_calibration_file_of_the_wrong_schema_is_refused(content, tmp_path, capsys, no_model):
    path = tmp_path / "calib.json"
    path.write_text(json.dumps(content))
    assert "--calibration" in _refused(["--target-sparsity", "0.3", "--calibration", str(path)], capsys)


def test_an_error_while_running_is_one_line_unless_debug(monkeypatch, tmp_path):
    import diffusers_trtllm.__main__ as cli

    def demo(args):
        raise RuntimeError("the run failed\nwith a second line")

    monkeypatch.setattr(cli, "run_demo", demo)
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path)])
    assert str(exit_info.value).count("\n") == 0 and "the run failed" in str(exit_info.value)
    assert "--debug" in str(exit_info.value)
    with pytest.raises(RuntimeError, match="the run failed"):
        main(["--out", str(tmp_path), "--debug"])


@pytest.mark.parametrize("argv", [["--model", "some/model"], ["calibrate", "--model", "m", "--prompts", "README.md"]])
def test_model_without_a_cuda_gpu_is_refused_in_the_argument_check(argv, monkeypatch, capsys, no_model):
    import diffusers_trtllm.__main__ as cli

    monkeypatch.setattr(cli, "cuda_device_count", lambda: 0)
    err = _refused(argv, capsys)
    assert "argument --model: run on a machine with a CUDA GPU, or drop --model" in err


def test_threshold_default_is_the_toys_offline_and_the_benchmarks_with_a_model(monkeypatch):
    """0.2 suits the demo's hand-made local attention only; a real model gets 0.05 unless the user says."""
    import diffusers_trtllm.__main__ as cli

    monkeypatch.setattr(cli, "cuda_device_count", lambda: 1)
    assert cli.parse_args([]).threshold == cli.DEFAULT_THRESHOLD == 0.2
    assert cli.parse_args(["--model", "some/model"]).threshold == cli.MODEL_THRESHOLD == 0.05
    assert cli.parse_args(["--model", "some/model", "--threshold", "0.1"]).threshold == 0.1


def test_model_without_a_cuda_gpu_answers_before_torch_is_imported():
    """The driver is asked with ctypes: no torch or Diffusers import (10-13 s on a 2-core machine) comes first."""
    child = ("import sys\nfrom diffusers_trtllm.__main__ import main\ntry:\n    main(['--model', 'some/model'])\n"
             "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules, 'diffusers' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert run.stdout.split() == ["2", "False", "False"], run.stdout + run.stderr
    assert "CUDA GPU" in run.stderr


def test_no_route_error_while_running_keeps_its_reasons_on_its_one_line(monkeypatch, capsys, tmp_path):
    import torch

    import diffusers_trtllm.__main__ as cli
    from diffusers_trtllm import attention

    def demo(args):
        q = torch.randn(1, 16, 1, 8)
        attention(q, q, q, skip=0.1, backend="sdpa")

    monkeypatch.setattr(cli, "run_demo", demo)
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path)])
    line = str(exit_info.value)
    assert len(line.splitlines()) == 1
    assert "backend='sdpa' cannot serve" in line and "no skip-softmax" in line and "fallback='dense'" in line, line


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(["--threshold", "--target-sparsity", "--disabled-until-timestep", "--steps", "--seed",
                             "--height"]),
       value=st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.integers(-10**6, 10**6).map(str),
                       st.text(max_size=12)))
def test_any_value_is_accepted_in_range_or_refused_in_one_line(flag, value, capsys):
    try:
        args = parse_args([f"{flag}={value}"])
    except SystemExit as exit_info:
        assert exit_info.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and flag in err
        return
    parsed = getattr(args, flag[2:].replace("-", "_"))
    if flag in ("--threshold",):
        assert 0.0 <= parsed < 1.0
    elif flag in ("--target-sparsity", "--disabled-until-timestep"):
        assert 0.0 <= parsed <= 1.0
    elif flag in ("--steps",):
        assert parsed >= 1
    elif flag == "--height":
        assert parsed % 16 == 0 and 16 <= parsed <= 256


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(low=st.floats(-2, 2), high=st.floats(-2, 2), tile=st.integers(-4, 300))
def test_calibrate_ranges_are_checked(low, high, tile, capsys):
    try:
        args = parse_calibrate_args(["--fit-range", repr(low), repr(high), "--tile", str(tile), "64"])
    except SystemExit as exit_info:
        assert exit_info.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
        return
    assert 0 <= args.fit_range[0] < args.fit_range[1] <= 1 and args.tile[0] >= 1


def test_route_names_the_cli_offers_are_the_registered_routes():
    import torch

    from diffusers_trtllm.config import CPU_ROUTES, ROUTE_NAMES
    from diffusers_trtllm.routing import get_route, route_names

    assert tuple(route_names()) == ROUTE_NAMES
    assert tuple(n for n in ROUTE_NAMES if "cpu" in get_route(n).caps.device_types) == CPU_ROUTES
    assert torch  # the registry needs torch; the command line does not


@pytest.mark.parametrize("argv", [["--help"], ["calibrate", "--help"], ["--threshold", "2"], ["--backend", "fa3"],
                                  ["calibrate", "--tile", "0", "1"]])
def test_help_and_argument_errors_answer_fast_without_torch(argv):
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "diffusers_trtllm", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - start
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert not {"torch", "diffusers", "transformers"} & imported
    assert done.returncode == (0 if "--help" in argv else 2)
    assert seconds < 2.0, seconds


def test_the_demo_command_says_its_times_are_not_speed_and_prints_no_torchvision_note(tmp_path):
    done = subprocess.run([sys.executable, "-m", "diffusers_trtllm", "--steps", "2", "--height", "16", "--width", "16",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "CPU wall time" in done.stdout and "say nothing of speed" in done.stdout
    assert "torchvision" not in done.stderr
    assert os.path.isfile(tmp_path / "comparison.png")
