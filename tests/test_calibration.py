"""Calibration loader on realistic ModelOpt-style config files."""

from __future__ import annotations

import json
import math

import pytest
import torch

import tiny_models
from diffusers_trtllm import TrtllmAttnProcessor, install, load_calibration, stats
from diffusers_trtllm.calibration.checkpoint import parse_sparse_attention_config
from diffusers_trtllm.serving.layer import layer_of


def _group(**over):
    group = {
        "algorithm": "skip_softmax",
        "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "coefficients": {"a": 2822.62, "b": 4.388}},
        "target_sparsity": 0.7,
        "disabled_until_timestep": 0.93,
        "ignore": ["blocks.0.attn1", "blocks.1.*"],
    }
    group.update(over)
    return {"sparse_attention_config": {"config_groups": {"group_0": group}}}


def _wan_with_config(tmp_path, config):
    """A tiny Wan transformer saved with the calibration in its config.json and loaded back."""
    from diffusers import WanTransformer3DModel

    model, _ = tiny_models.build("wan_t2v")
    model.save_pretrained(tmp_path)
    on_disk = json.loads((tmp_path / "config.json").read_text())
    on_disk.update(config)
    (tmp_path / "config.json").write_text(json.dumps(on_disk, indent=2))
    return WanTransformer3DModel.from_pretrained(tmp_path).eval()


def test_from_checkpoint_config(tmp_path):
    model = _wan_with_config(tmp_path, _group())
    proc = TrtllmAttnProcessor(backend="reference")  # no skip control: the checkpoint's operating point applies
    model.set_attn_processor(proc)
    summary = load_calibration(model)
    assert summary == {"transformer": {"calibrated": 1, "ignored": 3, "uncovered": 0}}
    layer = layer_of(model.blocks[0].attn2)
    skip = layer.settings().skip
    assert (skip.target_sparsity, skip.disabled_until_timestep) == (0.7, 0.93)
    assert math.isclose(skip.scale_factor(1000), 2822.62 * math.exp(4.388 * 0.7))
    assert not layer_of(model.blocks[0].attn1).settings().skip.configured  # ignored: stays dense
    assert layer_of(model.blocks[1].attn2).ignored


def test_a_compiled_model_keeps_its_layer_names_so_ignore_patterns_match():
    model, _ = tiny_models.build("wan_t2v")
    compiled = torch.compile(model)  # pipe.transformer = torch.compile(pipe.transformer): never run here
    proc = TrtllmAttnProcessor(target_sparsity=0.5, backend="reference")
    install(compiled, proc)
    assert [s.name for s in proc.layers] == ["blocks.0.attn1", "blocks.0.attn2", "blocks.1.attn1", "blocks.1.attn2"]
    assert load_calibration(compiled, _group()) == {"transformer": {"calibrated": 1, "ignored": 3, "uncovered": 0}}
    assert layer_of(model.blocks[0].attn1).ignored and not layer_of(model.blocks[0].attn2).ignored


def test_prefill_spelling_log_a_formula_and_user_target(tmp_path):
    config = _group(threshold_scale_factor={"formula": "exp(log_a + b * target_sparsity)",
                                            "prefill": {"log_a": math.log(2822.62), "b": 4.388}}, ignore=[])
    path = tmp_path / "calib.json"
    path.write_text(json.dumps(config))
    model, _ = tiny_models.build("wan_t2v")
    proc = TrtllmAttnProcessor(target_sparsity=0.5, disabled_until_timestep=0.8, backend="reference")
    model.set_attn_processor(proc)
    load_calibration(model, path)
    skip = layer_of(model.blocks[1].attn1).settings().skip
    assert (skip.target_sparsity, skip.disabled_until_timestep) == (0.5, 0.8)  # the user's choice wins
    assert math.isclose(skip.a, 2822.62) and skip.b == 4.388


def test_two_experts_get_their_own_curves():
    pipe, kwargs = tiny_models.wan_pipeline(two_experts=True)
    proc = TrtllmAttnProcessor(target_sparsity=0.6, backend="reference", collect_stats=True)
    pipe.transformer.set_attn_processor(proc)
    pipe.transformer_2.set_attn_processor(proc)
    high, low = _group(ignore=[]), _group(ignore=[])
    low["sparse_attention_config"]["config_groups"]["group_0"]["threshold_scale_factor"]["coefficients"] = {"a": 10.0, "b": 1.0}
    summary = load_calibration(pipe, {"transformer": high, "transformer_2": low})
    assert summary["transformer"]["calibrated"] == summary["transformer_2"]["calibrated"] == 4
    assert layer_of(pipe.transformer.blocks[0].attn1).calibration.a == 2822.62
    assert layer_of(pipe.transformer_2.blocks[0].attn1).calibration.a == 10.0
    out = pipe(**kwargs, num_inference_steps=2).frames
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    "config, message",
    [
        (_group(threshold_scale_factor={"formula": "a * b ** target_sparsity", "coefficients": {"a": 1, "b": 2}}),
         "formula 'a \\* b \\*\\* target_sparsity' is not supported"),
        (_group(threshold_scale_factor={"formula": "a * exp(b * target_sparsity)", "coefficients": {"a": 1}}),
         "needs 'coefficients' \\(or 'prefill'\\) with 'a' and 'b'"),
        (_group(algorithm="top_k"), "algorithm 'top_k' is not supported"),
        (_group(ignore="blocks.0.attn1"), "ignore must be a list"),
        (_group(target_sparsity=1.5), "target_sparsity must be in"),
        ({"sparse_attention_config": {"config_groups": {}}}, "non-empty \"config_groups\""),
        ({"sparse_attention_config": {"config_groups": {"group_0": [1, 2]}}}, "group 'group_0' must be an object"),
    ],
)
def test_malformed_configs_raise(config, message):
    with pytest.raises(ValueError, match=message):
        parse_sparse_attention_config(config)


def test_target_sparsity_without_a_curve_says_what_to_do():
    model, _ = tiny_models.build("wan_t2v")
    model.set_attn_processor(TrtllmAttnProcessor(target_sparsity=0.5, backend="reference"))
    config = _group(ignore=[], targets=["blocks.0.*"])
    with pytest.raises(ValueError, match="no calibration curve covers transformer.blocks.1.attn1.*skip_softmax_threshold"):
        load_calibration(model, config)
    with pytest.raises(ValueError, match="install it first"):
        load_calibration(tiny_models.build("flux")[0], config)


def test_user_gate_wins_over_the_checkpoint_and_sources_say_so(tmp_path):
    model = _wan_with_config(tmp_path, _group(ignore=["blocks.1.*"]))
    # Only the gate is the user's: the checkpoint's operating point fills the rest, not the gate.
    proc = TrtllmAttnProcessor(disabled_until_timestep=0.5, backend="reference")
    model.set_attn_processor(proc)
    load_calibration(model)
    state = layer_of(model.blocks[0].attn1)
    skip = state.settings().skip
    assert (skip.target_sparsity, skip.disabled_until_timestep) == (0.7, 0.5)
    sources = stats.setting_sources(state)
    assert sources["gate_source"] == "user"
    assert sources["skip_source"].startswith("checkpoint transformer:group_0")
    assert "ignore" in stats.setting_sources(layer_of(model.blocks[1].attn1))["skip_source"]
    # Nothing set by the user: the checkpoint's gate applies, and says where it came from.
    proc = TrtllmAttnProcessor(target_sparsity=0.4, backend="reference")
    model.set_attn_processor(proc)
    load_calibration(model)
    state = layer_of(model.blocks[0].attn1)
    assert state.settings().skip.disabled_until_timestep == 0.93
    assert stats.setting_sources(state)["gate_source"] == "checkpoint transformer:group_0"
    assert stats.setting_sources(state)["skip_source"] == "user, curve from checkpoint transformer:group_0"


def test_modelopt_per_phase_target_sparsity_is_read():
    (group,) = parse_sparse_attention_config(_group(target_sparsity={"prefill": 0.4, "decode": 0.4}))
    assert group.target_sparsity == 0.4
