"""Timestep gating: every step, the first included, runs dense or sparse by the rule ``t <= d``."""

from __future__ import annotations

import logging

import pytest
import torch
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback

import tiny_models
from diffusers_trtllm import DenoiseStepCallback, TrtllmAttnProcessor, attach_denoise_tracking, install, uninstall
from diffusers_trtllm.config import ControlTypeError
from diffusers_trtllm.serving.timestep import (TimestepHook, TimestepNormalizer, TimestepTracker, detach_denoise_tracking,
                                               tracking_hook)
from diffusers_trtllm.serving.layer import layer_of

STEPS = 5
GATE = 0.5


def _install(pipe, proc):
    for transformer in (pipe.transformer, getattr(pipe, "transformer_2", None)):
        if transformer is not None:
            transformer.set_attn_processor(proc)


def _expected(pipe) -> list[tuple[float, str]]:
    n = pipe.scheduler.config.num_train_timesteps
    return [(round(float(ts) / n, 4), "sparse" if float(ts) / n <= GATE else "dense") for ts in pipe.scheduler.timesteps]


def _observed(proc) -> list[tuple[float, str]]:
    return [(round(r["t"], 4), r["mode"]) for r in proc.step_table()]


@pytest.mark.parametrize(
    "build",
    [tiny_models.flux_pipeline, tiny_models.wan_pipeline, tiny_models.sd3_pipeline],
    ids=["flux_t_over_1000", "wan_raw", "sd3_raw_no_current_timestep"],
)
def test_hook_gates_every_step(build):
    pipe, kwargs = build()
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.1, disabled_until_timestep=GATE, backend="reference")
    _install(pipe, proc)
    attach_denoise_tracking(pipe, proc)
    pipe(**kwargs, num_inference_steps=STEPS)
    expected = _expected(pipe)
    assert {m for _, m in expected} == {"dense", "sparse"}, "the schedule must straddle the gate"
    assert _observed(proc) == expected
    # A second run restarts the statistics and gates the same way.
    pipe(**kwargs, num_inference_steps=STEPS)
    assert _observed(proc) == expected
    detach_denoise_tracking(pipe)


def test_wan22_two_experts_tracked():
    pipe, kwargs = tiny_models.wan_pipeline(two_experts=True)
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.1, disabled_until_timestep=GATE, backend="reference")
    _install(pipe, proc)
    attach_denoise_tracking(pipe, proc)
    pipe(**kwargs, num_inference_steps=STEPS)
    assert _observed(proc) == _expected(pipe)
    high = {r.step for s in proc.layers if s.name and s in [layer_of(m) for m in pipe.transformer.modules()
                                                          if layer_of(m) is not None] for r in s.records}
    assert high and len(high) < STEPS, "the high-noise expert serves the early steps only"


def test_callback_alone_first_step_dense_then_rule(caplog):
    pipe, kwargs = tiny_models.flux_pipeline()
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.1, disabled_until_timestep=0.9, backend="reference")
    _install(pipe, proc)
    detach_denoise_tracking(pipe, by_user=False)  # the callback alone, without the hook installing put on

    class Other(PipelineCallback):
        tensor_inputs = ["latents"]

        def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
            return callback_kwargs

    seen = []
    callback = DenoiseStepCallback(proc, on_step=lambda i, t: seen.append((i, t)))
    with caplog.at_level(logging.WARNING, logger="diffusers_trtllm"):
        pipe(**kwargs, num_inference_steps=STEPS, callback_on_step_end=MultiPipelineCallbacks([Other(), callback]))
    rows = proc.step_table()
    n = pipe.scheduler.config.num_train_timesteps
    # The first step's t is unknown to a callback (it runs after a step): dense, no warning.
    assert rows[0]["t"] is None and rows[0]["mode"] == "dense"
    later = [(round(r["t"], 4), r["mode"]) for r in rows[1:]]
    assert later == [(round(float(ts) / n, 4), "sparse" if float(ts) / n <= 0.9 else "dense")
                     for ts in pipe.scheduler.timesteps[1:]]
    assert seen[-1] == (STEPS - 1, None)
    assert not [r for r in caplog.records if "no denoising timestep" in r.message]


def test_gating_without_any_timestep_stays_dense_and_warns_once(caplog):
    """A layer served on its own (``set_processor`` on one module: no transformer forward whose timestep is read)."""
    from diffusers_trtllm import _logging

    _logging._warned.discard(("no-timestep",))
    model, inputs = tiny_models.build("flux")
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.1, disabled_until_timestep=0.5, backend="reference")
    model.transformer_blocks[0].attn.set_processor(proc)
    with caplog.at_level(logging.WARNING, logger="diffusers_trtllm"), torch.no_grad():
        model(**inputs)
        model(**inputs)
    assert proc.layers and all(not r.sparse for s in proc.layers for r in s.records)
    messages = [r.message for r in caplog.records if "no denoising timestep" in r.message]
    assert len(messages) == 1 and "set_attn_processor" in messages[0] and "attach_denoise_tracking" in messages[0]


# ---- one line: the transformer's own timestep, read on every forward -----------------------------
ONE_LINE_PIPELINES = {
    "flux": tiny_models.flux_pipeline, "wan": tiny_models.wan_pipeline, "sd3": tiny_models.sd3_pipeline,
    "hunyuanvideo": tiny_models.hunyuanvideo_pipeline, "qwenimage": tiny_models.qwenimage_pipeline,
    "ltx": tiny_models.ltx_pipeline,
}


@pytest.mark.parametrize("how", ["set_attn_processor", "install"])
@pytest.mark.parametrize("family", sorted(ONE_LINE_PIPELINES))
def test_one_line_gates_every_step(family, how):
    """``pipe.transformer.set_attn_processor(proc)`` (or ``install(pipe, proc)``) alone: each step's t comes from
    the timestep the pipeline hands its transformer, normalized by the family's convention (Flux's and
    Qwen-Image's t / 1000, the others' raw timestep)."""
    pipe, kwargs = ONE_LINE_PIPELINES[family]()
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.1, disabled_until_timestep=GATE, backend="reference")
    if how == "install":
        install(pipe, proc)
    else:
        pipe.transformer.set_attn_processor(proc)
    pipe(**kwargs, num_inference_steps=STEPS)
    expected = _expected(pipe)
    assert {m for _, m in expected} == {"dense", "sparse"}, "the schedule must straddle the gate"
    assert _observed(proc) == expected
    rows = proc.step_table()
    assert all(r["gated"] for r in rows if r["mode"] == "dense")
    table = proc.format_step_table()
    assert "dense (gated)" in table and "sparse" in table and "n/a" not in table


def test_attach_after_one_line_replaces_the_hook_not_adds_one():
    pipe, kwargs = tiny_models.flux_pipeline()
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.1, disabled_until_timestep=GATE, backend="reference")
    pipe.transformer.set_attn_processor(proc)
    assert tracking_hook(pipe.transformer).automatic
    attach_denoise_tracking(pipe, proc)
    hooks = [h for h in pipe.transformer._forward_pre_hooks.values() if isinstance(h, TimestepHook)]
    assert len(hooks) == 1 and not hooks[0].automatic
    pipe(**kwargs, num_inference_steps=STEPS)
    assert _observed(proc) == _expected(pipe)  # one step per step, not two
    pipe.transformer.set_attn_processor(proc)  # installing again keeps the user's hook
    assert tracking_hook(pipe.transformer) is hooks[0]


def test_the_automatic_hook_leaves_with_the_processor():
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    model, inputs = tiny_models.build("flux")
    model.set_attn_processor(TrtllmAttnProcessor())
    assert tracking_hook(model) is not None
    model.set_attn_processor(FluxAttnProcessor())
    assert tracking_hook(model) is None and not model._forward_pre_hooks
    install(model, TrtllmAttnProcessor())
    assert tracking_hook(model) is not None
    uninstall(model)
    assert tracking_hook(model) is None and not model._forward_pre_hooks
    attach_denoise_tracking(model, timestep_divisor=1.0)  # the user's stays when a stock processor comes back
    model.set_attn_processor(TrtllmAttnProcessor())
    model.set_attn_processor(FluxAttnProcessor())
    assert tracking_hook(model) is not None and not tracking_hook(model).automatic
    detach_denoise_tracking(model)


@pytest.mark.parametrize("convention, handed, t", [("t", 0.25, 0.25), ("raw", 1.0, 0.001), ("raw", 750.0, 0.75),
                                                    ("1-t", 0.25, 0.75)])
def test_family_conventions(convention, handed, t):
    assert TimestepNormalizer(None, convention=convention)(handed) == pytest.approx(t)


def test_a_timestep_of_several_values_counts_as_its_noisiest():
    """Per-sample (or per-token) timesteps that differ: skip-softmax starts once every one is past the gate."""
    for convention, values, t in (("raw", [200.0, 900.0], 0.9), ("1-t", [0.2, 0.6], 0.8)):
        tracker = TimestepTracker()
        tracker.normalizer = TimestepNormalizer(None, convention=convention)
        assert tracker.read(torch.tensor(values)) == pytest.approx(t)


def test_normalizer_detects_t_over_1000_and_raw():
    class Sched:
        config = {"num_train_timesteps": 1000}
        timesteps = torch.tensor([1000.0, 750.0, 501.0, 251.0, 1.0])

    class Pipe:
        scheduler = Sched()

    pipe = Pipe()  # held weakly by the normalizer
    norm = TimestepNormalizer(pipe)
    assert norm(750.0) == 0.75 and norm(0.75) == 0.75  # raw, and already divided
    assert norm(1.0) == 0.001  # raw last step of SD3's schedule, not "t = 1"
    assert abs(norm(0.5009765625) - 0.501) < 1e-9  # a bf16 reading snaps to the scheduler's value
    assert TimestepNormalizer(None)(900.0) == 0.9 and TimestepNormalizer(None, divisor=1.0)(0.3) == 0.3
    with pytest.raises(ValueError, match="normalized timestep"):
        TrtllmAttnProcessor().set_timestep(3.0)


@pytest.mark.parametrize("t", ["0.5", True, torch.tensor([0.1, 0.2])])
def test_set_timestep_refuses_what_is_not_a_number(t):
    with pytest.raises(ControlTypeError, match="t must be a number"):
        TrtllmAttnProcessor().set_timestep(t)


def test_set_timestep_takes_a_number_or_a_one_element_tensor():
    proc = TrtllmAttnProcessor()
    for t, expected in ((0.25, 0.25), (1, 1.0), (torch.tensor(0.5), 0.5), (torch.tensor([0.75]), 0.75), (None, None)):
        proc.set_timestep(t)
        assert proc._fallback_timestep == expected
