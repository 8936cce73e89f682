"""calibrate(): one dense pass per prompt, a fitted ModelOpt curve, written and read back, then hit."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import tiny_models
from diffusers_trtllm import TrtllmAttnProcessor, calibrate, load_calibration, save_calibration
from diffusers_trtllm.calibration.checkpoint import parse_sparse_attention_config
from diffusers_trtllm.calibration.fit import LayerStepSparsity, fit_groups
from diffusers_trtllm.locality import make_attention_local
from diffusers_trtllm.demo import build_demo_pipeline, install
from diffusers_trtllm.serving.layer import layer_of
from diffusers_trtllm.serving.timestep import tracking_hook

STEPS = 6


def _measured_sparsity(proc: TrtllmAttnProcessor) -> float:
    records = [r for s in proc.layers for r in s.records if r.total_tiles]
    return sum(r.skipped_tiles for r in records) / sum(r.total_tiles for r in records)


@pytest.fixture(scope="module")
def demo():
    pipe, inputs = build_demo_pipeline()
    pipe.set_progress_bar_config(disable=True)
    embeds = {k: inputs[k] for k in ("prompt_embeds", "pooled_prompt_embeds")}
    g = torch.Generator().manual_seed(7)
    other = {"prompt_embeds": torch.randn(1, 8, 32, generator=g), "pooled_prompt_embeds": torch.randn(1, 32, generator=g)}
    cal = calibrate(pipe, [embeds, other], steps=STEPS, height=inputs["height"], width=inputs["width"],
                    fit_range=(0.05, 0.95), target_sparsity=0.3)
    return pipe, inputs, cal


def test_calibrate_save_reload_and_hit_held_out_targets(demo, tmp_path):
    pipe, inputs, cal = demo
    (group,) = cal.groups["transformer"]
    assert group.observed[1] > 0.4 and group.fit_error < 0.08
    path = save_calibration(cal, tmp_path / "calib.json")
    on_disk = json.loads(open(path).read())
    (parsed,) = parse_sparse_attention_config(on_disk)
    assert math.isclose(parsed.a, group.a) and math.isclose(parsed.b, group.b) and parsed.target_sparsity == 0.3
    assert on_disk["sparse_attention_config"]["producer"]["name"] == "diffusers-trtllm"
    # The processors calibrate() installed are gone again.
    assert not any(layer_of(m) is not None and isinstance(m.processor, TrtllmAttnProcessor)
                   for m in pipe.transformer.modules())
    errors = {}
    for target in (0.15, 0.25, 0.35):  # none of them is a point of the fitted grid
        proc = TrtllmAttnProcessor(target_sparsity=target, backend="reference", collect_stats=True)
        install(pipe, proc)
        assert load_calibration(pipe, path) == {"transformer": {"calibrated": 2, "ignored": 0, "uncovered": 0}}
        pipe(**inputs, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0), output_type="latent")
        errors[target] = _measured_sparsity(proc) - target
    assert max(abs(e) for e in errors.values()) <= 0.05, errors


def test_checkpoint_operating_point_applies_without_user_control(demo, tmp_path):
    pipe, inputs, cal = demo
    path = save_calibration(cal, tmp_path / "calib.json")
    proc = TrtllmAttnProcessor(backend="reference", collect_stats=True)
    install(pipe, proc)
    load_calibration(pipe, path)
    pipe(**inputs, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0), output_type="latent")
    assert abs(_measured_sparsity(proc) - 0.3) <= 0.05


def test_calibrate_result_loads_straight_into_the_pipeline(demo):
    pipe, _, cal = demo
    proc = TrtllmAttnProcessor(target_sparsity=0.2, backend="reference")
    install(pipe, proc)
    assert load_calibration(pipe, cal) == load_calibration(pipe, cal.config())  # save_calibration takes either too
    (group,) = cal.groups["transformer"]
    assert all(math.isclose(s.calibration.a, group.a) for s in proc.layers)
    with pytest.raises(TypeError, match=r"calibrate\(\)'s result") as err:
        load_calibration(pipe, 3.5)
    assert len(str(err.value)) < 300


def test_table_is_long_format_per_layer_step_threshold(demo):
    _, _, cal = demo
    rows = cal.table()
    assert len(rows) == len(cal.measurements) * len(cal.thresholds)
    assert {r["step"] for r in rows} == set(range(STEPS))
    first = [r["skipped_fraction"] for r in rows[: len(cal.thresholds)]]
    assert first == sorted(first)  # a higher threshold never skips less


def test_fit_recovers_an_exponential_curve():
    a, b = 3.0, 9.0
    thresholds = tuple(np.geomspace(1e-6, 1.0, 73))
    kv_len, tiles = 1000, 100_000
    factors = np.asarray(thresholds) * kv_len
    sparsity = np.clip(np.log(factors / a) / b, 0.0, 0.95)  # S(F) of the curve F = a * exp(b * S)
    cell = LayerStepSparsity("transformer", "blocks.0.attn1", "self", 0, 0.5, kv_len, tiles,
                             (sparsity * tiles).round().astype(np.int64))
    (fitted,) = fit_groups([cell], thresholds)["transformer"]
    assert math.isclose(fitted.b, b, rel_tol=0.02) and math.isclose(fitted.a, a, rel_tol=0.05)
    assert fitted.fit_error < 0.005


def test_gated_steps_are_left_out_of_the_fit():
    thresholds = (0.01, 0.1, 1.0)
    early = LayerStepSparsity("transformer", "a", "self", 0, 0.95, 100, 10, np.array([9, 10, 10]))
    late = LayerStepSparsity("transformer", "a", "self", 1, 0.5, 100, 10, np.array([0, 3, 8]))
    (fitted,) = fit_groups([early, late], thresholds, disabled_until_timestep=0.9, fit_range=(0.0, 1.0))["transformer"]
    assert fitted.steps == (1,) and fitted.observed == (0.0, 0.8)


def test_flat_attention_says_there_is_nothing_to_calibrate():
    pipe, inputs = tiny_models.flux_pipeline()
    with pytest.raises(ValueError, match="flat"):
        calibrate(pipe, [inputs], steps=2)


def test_wan22_experts_get_their_own_curves(tmp_path):
    pipe, inputs = tiny_models.wan_pipeline(two_experts=True)
    make_attention_local(pipe.transformer, 55.0, seed=0, spread=0.5)
    make_attention_local(pipe.transformer_2, 25.0, seed=1, spread=0.5)
    inputs.update(height=128, width=128)
    cal = calibrate(pipe, [inputs], steps=4, tile=(16, 16), fit_range=(0.05, 0.95))
    high, low = cal.groups["transformer"][0], cal.groups["transformer_2"][0]
    assert set(high.steps).isdisjoint(low.steps) and (high.a, high.b) != (low.a, low.b)
    path = save_calibration(cal, tmp_path / "wan22.json")
    config = json.loads(open(path).read())
    assert set(config) == {"transformer", "transformer_2"}
    proc = TrtllmAttnProcessor(target_sparsity=0.2, backend="reference")
    install(pipe, proc)
    load_calibration(pipe, path)
    assert math.isclose(layer_of(pipe.transformer_2.blocks[0].attn1).calibration.a, low.a)
    assert math.isclose(layer_of(pipe.transformer.blocks[0].attn1).calibration.a, high.a)


@pytest.mark.parametrize("group_by", ["role", "layer"])
def test_groups_by_role_or_layer_name_their_modules(demo, group_by):
    pipe, inputs, _ = demo
    embeds = {k: inputs[k] for k in ("prompt_embeds", "pooled_prompt_embeds")}
    cal = calibrate(pipe, [embeds], steps=2, height=inputs["height"], width=inputs["width"], group_by=group_by,
                    fit_range=(0.05, 0.95))
    groups = cal.groups["transformer"]
    assert len(groups) == 2 and all(g.targets for g in groups)
    config = cal.config()["sparse_attention_config"]["config_groups"]
    assert [g["targets"] for g in config.values()] == [list(g.targets) for g in groups]


def test_bad_arguments_are_refused():
    pipe, inputs = tiny_models.flux_pipeline()
    with pytest.raises(ValueError, match="increasing values in"):
        calibrate(pipe, [inputs], thresholds=(0.5, 2.0))
    with pytest.raises(ValueError, match="group_by"):
        fit_groups([], (0.1, 1.0), group_by="head")
    with pytest.raises(ValueError, match="not its transformer"):
        calibrate(pipe.transformer, [inputs])
    with pytest.raises(ValueError, match="at least one prompt"):
        calibrate(pipe, [])


def test_calibrate_restores_the_users_processor_and_tracking(demo):
    pipe, inputs, _ = demo
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.1, backend="reference")
    install(pipe, proc)
    embeds = {k: inputs[k] for k in ("prompt_embeds", "pooled_prompt_embeds")}
    calibrate(pipe, [embeds], steps=2, height=inputs["height"], width=inputs["width"], fit_range=(0.05, 0.95))
    assert all(p is proc for p in pipe.transformer.attn_processors.values())
    assert tracking_hook(pipe.transformer) is not None


def test_what_we_write_reads_back_without_warnings(demo, tmp_path, caplog):
    _, _, cal = demo
    path = save_calibration(cal, tmp_path / "calib.json")
    with caplog.at_level("WARNING"):
        parse_sparse_attention_config(json.loads(open(path).read()))
    assert not [r for r in caplog.records if "unknown" in r.getMessage() or "ignored" in r.getMessage()]
