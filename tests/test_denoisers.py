"""One rule for a pipeline's denoisers (``serving.modules``): install, calibrate, load / save_calibration
and attach_denoise_tracking all serve a UNet pipeline's ``unet`` (and Wan 2.2's two experts, see
test_calibrator.py and test_calibration.py), never its text encoder."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import DDIMScheduler

import family_models
import tiny_models
from diffusers_trtllm import (TrtllmAttnProcessor, attach_denoise_tracking, calibrate, install, load_calibration,
                              save_calibration, uninstall)
from diffusers_trtllm.serving.layer import layer_of
from diffusers_trtllm.serving.modules import denoisers
from diffusers_trtllm.serving.timestep import tracking_hook


class TinyUNetPipeline:
    """A pipeline as the library sees one: components, a scheduler, a call running the UNet once per step."""

    def __init__(self) -> None:
        self.unet, self.inputs = family_models.build("UNet2DCondition")
        self.text_encoder = torch.nn.Linear(8, 8)  # a module, not a denoiser: never served
        self.scheduler = DDIMScheduler(num_train_timesteps=1000)

    @property
    def components(self) -> dict:
        return {"unet": self.unet, "text_encoder": self.text_encoder, "scheduler": self.scheduler}

    @torch.no_grad()
    def __call__(self, num_inference_steps: int = 2, **_ignored) -> torch.Tensor:
        self.scheduler.set_timesteps(num_inference_steps)
        sample = self.inputs["sample"]
        for t in self.scheduler.timesteps:
            sample = self.unet(sample, t, encoder_hidden_states=self.inputs["encoder_hidden_states"],
                               return_dict=False)[0]
        return sample


def _group(a: float) -> dict:
    curve = {"formula": "a * exp(b * target_sparsity)", "coefficients": {"a": a, "b": 4.0}}
    return {"sparse_attention_config": {"config_groups": {"group_0": {"algorithm": "skip_softmax",
                                                                      "threshold_scale_factor": curve}}}}


def test_the_rule_names_unet_and_both_wan_experts():
    assert list(denoisers(TinyUNetPipeline())) == ["unet"]
    pipe, _ = tiny_models.wan_pipeline(two_experts=True)
    assert sorted(denoisers(pipe)) == ["transformer", "transformer_2"]


def test_unet_pipeline_is_served_tracked_and_calibrated_by_every_entry_point(tmp_path):
    pipe = TinyUNetPipeline()
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.05, disabled_until_timestep=0.3, backend="reference")
    install(pipe, proc)
    served = [m for m in pipe.unet.modules() if layer_of(m) is not None]
    assert served and layer_of(pipe.text_encoder) is None
    attach_denoise_tracking(pipe)
    assert tracking_hook(pipe.unet) is not None
    pipe(num_inference_steps=2)
    # the hook handed each step's t to the UNet's layers: dense while t > 0.3, sparse after
    steps = [(row["t"], row["gated"], row["mode"]) for row in proc.step_table()]
    assert steps == [(0.5, True, "dense"), (0.0, False, "sparse")]

    path = save_calibration({"unet": _group(7.0)}, tmp_path / "unet.json")
    assert set(json.loads(open(path).read())) == {"unet"}
    summary = load_calibration(pipe, path)
    assert summary["unet"]["calibrated"] == len(served)
    assert layer_of(served[0]).calibration.a == 7.0

    uninstall(pipe)
    with pytest.raises(ValueError, match="flat"):  # measured (random weights skip nothing), not "no transformer"
        calibrate(pipe, [{}], steps=2)
