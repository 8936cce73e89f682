"""proc.summary() / proc.plot(): per layer and step, what ran and how much it skipped."""

from __future__ import annotations

import builtins

import pytest
import torch

from diffusers_trtllm import TrtllmAttnProcessor
from diffusers_trtllm.demo import build_demo_pipeline, install


@pytest.fixture(scope="module")
def pipeline_run():
    pipe, inputs = build_demo_pipeline()
    pipe.set_progress_bar_config(disable=True)
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.1, disabled_until_timestep=0.6, quant={"dtype_qk": "int8"},
                               backend="reference")
    install(pipe, proc)
    pipe(**inputs, num_inference_steps=4, generator=torch.Generator().manual_seed(0), output_type="latent")
    return pipe, proc  # the layers' states live on the pipeline's modules: keep it alive


@pytest.fixture
def ran(pipeline_run):
    return pipeline_run[1]


def test_summary_rows_per_layer_and_step(ran):
    rows = ran.summary()
    assert len(rows) == 2 * 4  # two attention layers, four steps
    assert {r["layer"] for r in rows} == {"transformer_blocks.0.attn", "single_transformer_blocks.0.attn"}
    by_step = {r["step"]: r for r in rows if r["layer"] == "transformer_blocks.0.attn"}
    # t = 1, .75 are above the gate: dense (gated), and SAGE still ran (int8), so neither reads as full precision.
    assert [by_step[s]["attention"] for s in range(4)] == ["dense (gated)"] * 2 + ["sparse"] * 2
    assert all(r["sage_dtype"] == "int8" and r["sage"] for r in rows) and all(r["route"] == "reference" for r in rows)
    assert all(r["skipped_fraction"] > 0 for r in rows if r["attention"] == "sparse")
    assert {r["skip_source"] for r in rows} == {"user"} and {r["quant_source"] for r in rows} == {"user"}


def test_summary_goes_into_a_dataframe(ran):
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame(ran.summary())
    assert frame.shape[0] == 8 and {"layer", "step", "skipped_fraction", "sage_dtype", "skip_source"} <= set(frame.columns)


def test_step_table_labels_gated_steps(ran):
    text = ran.format_step_table()
    assert "dense (gated)" in text and "int8" in text and "settings from:" in text
    assert [r["gated"] for r in ran.step_table()] == [True, True, False, False]


def test_plot_writes_a_heatmap(ran, tmp_path):
    pytest.importorskip("matplotlib")
    path = ran.plot(str(tmp_path / "sparsity.png"))
    assert (tmp_path / "sparsity.png").stat().st_size > 1000 and path.endswith("sparsity.png")


def test_plot_without_matplotlib_says_how_to_get_it(ran, tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        ran.plot(str(tmp_path / "x.png"))


def test_plot_before_any_run_says_so(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="run the pipeline first"):
        TrtllmAttnProcessor().plot(str(tmp_path / "x.png"))


def test_diffusers_verbosity_controls_our_warnings(capsys):
    from diffusers.utils import logging as diffusers_logging

    from diffusers_trtllm._logging import logger, warn_once

    before = diffusers_logging.get_verbosity()
    try:
        diffusers_logging.set_verbosity_error()
        assert not logger.isEnabledFor(diffusers_logging.WARNING)
        warn_once(("test-verbosity", 1), "silenced by set_verbosity_error")
        diffusers_logging.set_verbosity_warning()
        assert logger.isEnabledFor(diffusers_logging.WARNING)
    finally:
        diffusers_logging.set_verbosity(before)
    assert "silenced by set_verbosity_error" not in capsys.readouterr().err
