"""What a demanding user does on tiny models (issue 20): inference mode, autograd on, fused projections,
repeated runs, several processors, and the files and arguments they hand over."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import tiny_models
from diffusers_trtllm import (
    DenoiseStepCallback, TrtllmAttnProcessor, attach_denoise_tracking, calibrate, detach_denoise_tracking, install,
    load_calibration, save_calibration, uninstall,
)
from diffusers_trtllm.calibration.checkpoint import read_calibration, sparse_attention_config
from diffusers_trtllm.demo import build_demo_pipeline

STEPS = 4


def _warnings(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


# ---- 1. inference mode -------------------------------------------------------------------------
def test_inference_mode_pipeline_with_tracking_and_a_masked_family():
    pipe, kwargs = tiny_models.flux_pipeline()
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.1, disabled_until_timestep=0.5, backend="reference")
    install(pipe, proc)
    attach_denoise_tracking(pipe, proc)
    with torch.inference_mode():
        pipe(**kwargs, num_inference_steps=STEPS)
    rows = proc.step_table()
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert {r["mode"] for r in rows} == {"dense", "sparse"}
    # A masked family (Qwen-Image pads its text mask): the layout cache keys an inference tensor too.
    model, inputs = tiny_models.build("qwenimage")
    with torch.no_grad():
        stock = model(**inputs)[0]
    install(model, TrtllmAttnProcessor())
    with torch.inference_mode():
        ours = model(**inputs)[0]
        again = model(**inputs)[0]
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, stock, rtol=1e-5, atol=1e-5)


# ---- 2. autograd on --------------------------------------------------------------------------------
def test_grad_enabled_call_is_recorded_stock_with_the_reason_logged_once(caplog, fresh_warnings):
    model, inputs = tiny_models.build("flux")
    proc = TrtllmAttnProcessor(quant="int8", backend="reference")
    install(model, proc)
    with caplog.at_level(logging.WARNING, logger="diffusers_trtllm"):
        model(**inputs)
        model(**inputs)
    rows = proc.step_table()  # both calls at the inputs' timestep: one step
    assert len(rows) == 1 and all(r["routes"] == "stock" and not r["sage"] for r in rows)
    assert all("autograd" in r["policy"] for r in rows)
    messages = _warnings(caplog, "autograd")
    assert len(messages) == 1 and "torch.no_grad" in messages[0] and "role" in messages[0]


# ---- 3. fused projections ----------------------------------------------------------------------
@pytest.mark.parametrize("family", ["sd3", "flux", "cogvideox"])
def test_fuse_qkv_projections_after_install_keeps_every_layer_served(family):
    model, inputs = tiny_models.build(family)
    with torch.no_grad():
        stock = model(**inputs)[0]
    proc = TrtllmAttnProcessor()
    install(model, proc)
    served = len(proc.layers)
    model.fuse_qkv_projections()
    assert len(proc.layers) == served
    with torch.no_grad():
        ours = model(**inputs)[0]
    torch.testing.assert_close(ours, stock, rtol=1e-4, atol=1e-4)
    assert {r["routes"] for r in proc.step_table()} == {"sdpa"}
    assert all(len(s.records) == 1 for s in proc.layers)


def test_unfuse_after_install_puts_the_unfused_stock_back():
    """SD3's unfuse_qkv_projections() re-sets the processors it saved at fusing (ours): the stock processors
    the fuse replaced come back under ours, and uninstall leaves what stock Diffusers would (a LoRA loaded
    afterwards into to_q / to_k / to_v is used again)."""
    model, inputs = tiny_models.build("sd3")
    reference, _ = tiny_models.build("sd3")
    reference.fuse_qkv_projections()
    reference.unfuse_qkv_projections()
    expected = {type(p).__name__ for p in reference.attn_processors.values()}
    proc = TrtllmAttnProcessor()
    install(model, proc)
    model.fuse_qkv_projections()
    assert {type(s.stock).__name__ for s in proc.layers} == {"FusedJointAttnProcessor2_0"}
    model.unfuse_qkv_projections()
    assert {type(s.stock).__name__ for s in proc.layers} == expected == {"JointAttnProcessor2_0"}
    with torch.no_grad():
        model(**inputs)
    assert all(len(s.records) == 1 for s in proc.layers)
    uninstall(model)
    assert {type(p).__name__ for p in model.attn_processors.values()} == expected


# ---- 4, 5. each run's and each processor's table is its own, from step 0 -----------------------
def _steps(proc) -> list[int]:
    return [r["step"] for r in proc.step_table()]


def test_callback_runs_each_start_at_step_zero(caplog, fresh_warnings):
    pipe, kwargs = tiny_models.flux_pipeline()
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.1, disabled_until_timestep=0.9, backend="reference")
    install(pipe, proc)
    detach_denoise_tracking(pipe, by_user=False)  # the callback alone, without the hook installing put on
    callback = DenoiseStepCallback(proc)
    first = None
    for _ in range(3):
        pipe(**kwargs, num_inference_steps=STEPS, callback_on_step_end=callback)
        rows = proc.step_table()
        assert _steps(proc) == list(range(STEPS))
        assert rows[0]["t"] is None
        first = first or [r["t"] for r in rows]
        assert [r["t"] for r in rows] == first
    # After detaching the hook, a new processor fed by the callback also starts at step 0, with no advice
    # to attach tracking (the callback is there).
    attach_denoise_tracking(pipe)
    pipe(**kwargs, num_inference_steps=STEPS)
    detach_denoise_tracking(pipe)
    other = TrtllmAttnProcessor(skip_softmax_threshold=0.1, disabled_until_timestep=0.9, backend="reference")
    install(pipe, other)
    detach_denoise_tracking(pipe, by_user=False)
    with caplog.at_level(logging.WARNING, logger="diffusers_trtllm"):
        pipe(**kwargs, num_inference_steps=STEPS, callback_on_step_end=DenoiseStepCallback(other))
    assert _steps(other) == list(range(STEPS))
    assert not _warnings(caplog, "attach_denoise_tracking")


def test_second_processor_on_the_same_model_has_its_own_table():
    pipe, kwargs = tiny_models.flux_pipeline()
    first = TrtllmAttnProcessor(skip_softmax_threshold=0.1, backend="reference")
    install(pipe, first)
    attach_denoise_tracking(pipe)
    pipe(**kwargs, num_inference_steps=STEPS)
    before = first.format_step_table()
    second = TrtllmAttnProcessor(backend="reference")
    install(pipe, second)
    pipe(**kwargs, num_inference_steps=STEPS + 2)
    assert _steps(second) == list(range(STEPS + 2))
    assert first.format_step_table() == before and _steps(first) == list(range(STEPS))
    assert {r["mode"] for r in first.step_table()} == {"sparse"}
    assert {r["mode"] for r in second.step_table()} == {"dense"}


def test_step_table_before_any_call_and_sage_column_aligned():
    proc = TrtllmAttnProcessor(quant="fp8_e4m3", backend="reference")
    assert "nothing ran yet" in proc.format_step_table()
    model, inputs = tiny_models.build("flux")
    install(model, proc)
    assert "nothing ran yet" in proc.format_step_table()
    rows = [{"step": 0, "t": 0.5, "mode": "dense", "gated": False, "skipped_fraction": None, "sage": True,
             "sage_dtype": "fp8_e4m3/off", "routes": "reference", "policy": ""},
            {"step": 1, "t": 0.25, "mode": "sparse", "gated": False, "skipped_fraction": 0.5, "sage": True,
             "sage_dtype": "int8", "routes": "reference", "policy": ""}]
    from diffusers_trtllm.stats import format_step_table

    lines = format_step_table(rows).splitlines()
    assert len({line.index("reference") for line in lines[1:]}) == 1
    assert lines[0].index("route") == lines[1].index("reference")


# ---- 6. calibrate() leaves no "detached" behind ------------------------------------------------
def test_calibrate_without_tracking_then_a_run_gives_no_detach_warning(caplog, fresh_warnings):
    pipe, inputs = build_demo_pipeline()
    pipe.set_progress_bar_config(disable=True)
    embeds = {k: inputs[k] for k in ("prompt_embeds", "pooled_prompt_embeds")}
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.2, disabled_until_timestep=0.9, backend="reference")
    install(pipe, proc)
    calibrate(pipe, [embeds], steps=3, height=32, width=32, fit_range=(0.05, 0.95))
    with caplog.at_level(logging.WARNING, logger="diffusers_trtllm"):
        pipe(**embeds, height=32, width=32, num_inference_steps=2, output_type="latent",
             callback_on_step_end=DenoiseStepCallback(proc))
    assert not _warnings(caplog, "detached")
    assert _steps(proc) == [0, 1]


# ---- 7. warnings once per cause, naming the role; fallback warnings short ---------------------
def test_no_timestep_warning_once_per_forward_naming_the_role(caplog, fresh_warnings):
    model, inputs = tiny_models.build("flux")
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.1, disabled_until_timestep=0.5, backend="reference")
    install(model, proc)
    detach_denoise_tracking(model, by_user=False)  # no source of t at all
    with caplog.at_level(logging.WARNING, logger="diffusers_trtllm"), torch.no_grad():
        model(**inputs)
    messages = _warnings(caplog, "no denoising timestep")
    assert len(messages) == 1 and "role" in messages[0]


def test_fallback_dense_warns_once_briefly_without_advising_fallback(caplog, fresh_warnings):
    model, inputs = tiny_models.build("flux")
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.1, quant="int8", fallback="dense")
    install(model, proc)
    with caplog.at_level(logging.WARNING, logger="diffusers_trtllm"), torch.no_grad():
        model(**inputs)
    messages = _warnings(caplog, "fallback")
    assert len(messages) == 1, messages
    assert "pass fallback" not in messages[0] and len(messages[0].splitlines()) <= 2
    assert "role" in messages[0] and "skip-softmax" in messages[0] and "SAGE" in messages[0]


# ---- 8. calibration files ------------------------------------------------------------------------
def test_save_calibration_object_into_a_checkpoint_folder(tmp_path):
    model, _ = tiny_models.build("flux")
    model.save_pretrained(tmp_path / "transformer")
    config = sparse_attention_config([("group_0", 100.0, 3.0, None, None)], target_sparsity=0.3)
    save_calibration(config, tmp_path / "transformer")
    on_disk = json.loads((tmp_path / "transformer" / "config.json").read_text())
    assert on_disk["sparse_attention_config"]["config_groups"]["group_0"]["target_sparsity"] == 0.3
    proc = TrtllmAttnProcessor(backend="reference")
    install(model, proc)
    assert load_calibration(model, tmp_path / "transformer")["transformer"]["calibrated"] == len(proc.layers)


@pytest.mark.parametrize("text, what", [("[" * 100_000 + "]" * 100_000, "nested"), ('{"a": ' + "9" * 5000 + "}", "digits")])
def test_hostile_calibration_files_name_the_file(tmp_path, text, what):
    path = tmp_path / f"{what}.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"{what}.json"):
        read_calibration(path)


# ---- 9. install() on something that is not a model ------------------------------------------------
@pytest.mark.parametrize("target", [42, "transformer", None])
def test_install_on_a_non_model_is_a_clear_type_error(target):
    with pytest.raises(TypeError, match="pipeline or a torch.nn.Module"):
        install(target, TrtllmAttnProcessor())
    with pytest.raises(TypeError, match="pipeline or a torch.nn.Module"):
        uninstall(target)


def test_reinstalling_after_uninstall_starts_a_new_table():
    pipe, kwargs = tiny_models.flux_pipeline()
    proc = TrtllmAttnProcessor(backend="reference")
    install(pipe, proc)
    attach_denoise_tracking(pipe)
    pipe(**kwargs, num_inference_steps=STEPS)
    uninstall(pipe)
    assert _steps(proc) == list(range(STEPS))  # the table outlives uninstall
    install(pipe, proc)
    attach_denoise_tracking(pipe)
    pipe(**kwargs, num_inference_steps=STEPS)
    rows = proc.step_table()
    assert _steps(proc) == list(range(STEPS)) and {r["calls"] for r in rows} == {len(proc.layers)}
