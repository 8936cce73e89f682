"""Issue 13: every bad input gets a clear error naming the control, the value and what is allowed;
convenient forms are accepted where unambiguous. One test per row of the issue's table (the mask rows
live in test_processor_masks.py, the kernel rows in test_triton_attn.py)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

import tiny_models
from diffusers_trtllm import (
    DenoiseStepCallback,
    QuantConfig,
    ControlTypeError,
    SkipSoftmaxConfig,
    TrtllmAttnProcessor,
    attach_denoise_tracking,
    attention,
    install,
    load_calibration,
)
from diffusers_trtllm.__main__ import parse_args


def _qkv(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 40, 2, 16, generator=gen).to(dtype) for _ in range(3)]


# ---- row 1: processor controls ---------------------------------------------------------------------

def test_processor_public_surface_is_the_users():
    """``help(TrtllmAttnProcessor)`` lists what a user calls; what layers and setters use is underscored."""
    public = {name for name in dir(TrtllmAttnProcessor) if not name.startswith("_")}
    public |= {name for name in vars(TrtllmAttnProcessor()) if not name.startswith("_")}
    user = {"set_timestep", "step_table", "format_step_table", "summary", "layer_step_rows", "plot", "reset_stats",
            "layers", "roles", "collect_stats"}
    hub = {"save_pretrained", "from_pretrained", "push_to_hub"}  # issue 56's, where it has landed
    assert user <= public <= user | hub, sorted(public - user - hub)


def test_repr_says_what_the_parameter_table_says():
    assert repr(TrtllmAttnProcessor()) == ("TrtllmAttnProcessor(skip_softmax_threshold=None, target_sparsity=None, "
                                           "disabled_until_timestep=None, quant=None, backend='auto', layers=0)")
    text = repr(TrtllmAttnProcessor(skip_softmax_threshold=0.2, disabled_until_timestep=0.9, quant="int8",
                                    roles={"cross": "dense"}, fused_rotary=False))
    assert text == ("TrtllmAttnProcessor(skip_softmax_threshold=0.2, target_sparsity=None, disabled_until_timestep=0.9, "
                    "quant='int8', backend='auto', roles={'cross': 'dense'}, fused_rotary=False, layers=0)")


@pytest.mark.parametrize("value", ["no", 0, None])
def test_fused_rotary_takes_a_bool_only(value):
    with pytest.raises(ControlTypeError, match="fused_rotary must be True or False"):
        TrtllmAttnProcessor(fused_rotary=value)


def test_processor_accepts_a_dtype_name_for_quant():
    for quant in ("int8", torch.int8, {"dtype_qk": "INT8"}):
        assert TrtllmAttnProcessor(quant=quant)._role_settings["self"].quant == QuantConfig("int8")
    assert TrtllmAttnProcessor(quant="fp8")._role_settings["self"].quant.dtype_qk == "fp8_e4m3"


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"quant": 8}, r"quant must be a dict .* got 8 \(int\)"),
        ({"roles": ["self"]}, r"roles must be a dict .* got \['self'\] \(list\)"),
        ({"quant": {"dtype_qk": []}}, r"quant.dtype_qk must be a dtype name .* got \[\] \(list\)"),
        ({"backend": ["triton"]}, r"backend must be a route name"),
        ({"skip_softmax_threshold": "0.1"}, r"skip_softmax_threshold must be a number; got '0.1'"),
    ],
)
def test_processor_rejects_wrong_types_with_type_error(kwargs, needle):
    with pytest.raises(TypeError, match=needle):
        TrtllmAttnProcessor(**kwargs)


@pytest.mark.parametrize("value", ["no", 1, None])
def test_collect_stats_takes_a_bool_only(value):
    with pytest.raises(TypeError, match=r"collect_stats must be True or False; got"):
        TrtllmAttnProcessor(collect_stats=value)


def test_unknown_keys_suggest_the_closest():
    with pytest.raises(ValueError, match=r"'dtype_q' \(did you mean 'dtype_qk'\?\)"):
        TrtllmAttnProcessor(quant={"dtype_q": "int8"})
    with pytest.raises(ValueError, match=r"'slef' \(did you mean 'self'\?\)"):
        TrtllmAttnProcessor(roles={"slef": "dense"})
    # The functional API's short name, in a role's settings: the processor's full name is suggested.
    with pytest.raises(ValueError, match=r"'threshold' \(did you mean 'skip_softmax_threshold'\?\)"):
        TrtllmAttnProcessor(roles={"self": {"threshold": 0.1}})


# ---- row 2: functional skip forms ------------------------------------------------------------------

def test_functional_skip_accepts_a_threshold_or_a_dict():
    q, k, v = _qkv()
    kw = dict(backend="reference", collect_stats=True)
    expected = attention(q, k, v, skip=SkipSoftmaxConfig(threshold=0.1), **kw)
    for skip in (0.1, {"threshold": 0.1}, {"skip_softmax_threshold": 0.1, "disabled_until_timestep": None}):
        torch.testing.assert_close(attention(q, k, v, skip=skip, **kw), expected, rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"skip must be a SkipSoftmaxConfig, a threshold in \[0, 1\), a dict"):
        attention(q, k, v, skip="0.1")
    with pytest.raises(ValueError, match=r"'treshold' \(did you mean 'threshold'\?\)"):
        attention(q, k, v, skip={"treshold": 0.1})


# ---- row 3: thresholds where the rule means sparsity -----------------------------------------------

@pytest.mark.parametrize("threshold", [1, 2, 1e3])
def test_threshold_must_be_below_one(threshold):
    with pytest.raises(ValueError, match=r"skip_softmax_threshold must be finite and in \[0.0, 1.0\); got"):
        SkipSoftmaxConfig(threshold=threshold)
    with pytest.raises(ValueError, match="skip_softmax_threshold"):
        TrtllmAttnProcessor(skip_softmax_threshold=threshold)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="skip_softmax_threshold"):
        attention(q, k, v, skip=threshold)
    assert SkipSoftmaxConfig(threshold=0.999).threshold == 0.999


# ---- rows 4-6: calibration -------------------------------------------------------------------------

def _calibration(**over):
    group = {
        "algorithm": "skip_softmax",
        "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "coefficients": {"a": 2822.62, "b": 4.388}},
        "target_sparsity": 0.7,
    }
    group.update(over)
    return {"sparse_attention_config": {"config_groups": {"group_0": group}}}


def _model_with_processor():
    model, _ = tiny_models.build("wan_t2v")
    model.set_attn_processor(TrtllmAttnProcessor(backend="reference"))
    return model


@pytest.mark.parametrize(
    "curve, needle",
    [
        ({"formula": "a * exp(b * target_sparsity)", "coefficients": {"a": 2822.62, "b": 1000}}, "overflows"),
        ({"formula": "a * exp(b * target_sparsity)", "coefficients": {"a": 1e308, "b": 1.0}}, "overflows"),
        ({"formula": "exp(log_a + b * target_sparsity)", "coefficients": {"log_a": 1000, "b": 1.0}}, "log_a must be <= 700"),
        ({"formula": "a * exp(b * target_sparsity)", "coefficients": {"a": 1e-300, "b": -1000}}, "underflows"),
        ({"formula": "a * exp(b * target_sparsity)", "coefficients": {"a": 10**400, "b": 1}}, "a must be a finite number"),
    ],
)
def test_calibration_curve_checked_at_load(curve, needle):
    model = _model_with_processor()
    with pytest.raises(ValueError, match=f"group 'group_0'.*{needle}"):
        load_calibration(model, _calibration(threshold_scale_factor=curve))
    with pytest.raises(ValueError, match="calibration"):
        SkipSoftmaxConfig(target_sparsity=0.5, a=1e308, b=1.0)


@pytest.mark.parametrize("content", [b"{", b"", b'{"a": "\xff"}', b"null", b"[1, 2]"])
def test_calibration_file_errors_name_the_path(tmp_path, content):
    path = tmp_path / "calib.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"calibration file '{path}'"):
        load_calibration(_model_with_processor(), path)


def test_calibration_bad_ignore_and_source_type():
    with pytest.raises(ValueError, match="ignore must be a list of fnmatch patterns; got 5"):
        load_calibration(_model_with_processor(), _calibration(ignore=5))
    with pytest.raises(TypeError, match="calibration must be a path"):
        load_calibration(_model_with_processor(), 5)


def test_calibration_unknown_key_warns_with_closest(caplog):
    with caplog.at_level(logging.WARNING, logger="diffusers_trtllm"):
        load_calibration(_model_with_processor(), _calibration(disable_until_timestep=0.9, ignore=[]))
    assert "'disable_until_timestep' (did you mean 'disabled_until_timestep'?)" in caplog.text


# ---- row 7: timestep tracking ----------------------------------------------------------------------

def test_timestep_tracking_arguments_checked():
    model, _ = tiny_models.build("wan_t2v")
    proc = TrtllmAttnProcessor()
    for divisor in (math.inf, math.nan, 0, -1000):
        with pytest.raises(ValueError, match="timestep_divisor must be finite and > 0"):
            attach_denoise_tracking(model, proc, timestep_divisor=divisor)
    with pytest.raises(TypeError, match=r"timestep_divisor must be a number .* got '1000' \(str\)"):
        attach_denoise_tracking(model, proc, timestep_divisor="1000")
    with pytest.raises(TypeError, match="object has no transformer to track"):
        attach_denoise_tracking(object(), proc)
    with pytest.raises(TypeError, match="needs the TrtllmAttnProcessor"):
        attach_denoise_tracking(model, object())
    with pytest.raises(TypeError, match="DenoiseStepCallback needs the TrtllmAttnProcessor"):
        DenoiseStepCallback(object())
    with pytest.raises(TypeError, match="on_step must be a callable"):
        DenoiseStepCallback(proc, on_step=5)
    attach_denoise_tracking(model, proc, timestep_divisor=1000)  # the accepted form still works


# ---- row 9: mixed dtypes ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "sdpa", "auto"])
def test_mixed_dtypes_refused_on_every_route(backend):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"share one floating dtype .* torch.float32, torch.float16, torch.float32"):
        attention(q, k.half(), v, backend=backend)
    with pytest.raises(ValueError, match="share one floating dtype"):
        attention(q.long(), k.long(), v.long(), backend=backend)


# ---- tensor layouts: SDPA's and sageattn's [batch, heads, tokens, dim] by name -----------------------

@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_heads_first_tensors_by_tensor_layout(backend):
    """``tensor_layout="HND"`` takes and returns ``[batch, heads, tokens, dim]`` (SDPA's layout): the same
    attention as the default ``"NHD"`` on the transposed tensors, and SDPA's own answer."""
    q, k, v = (torch.randn(1, 8, 96, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    out = attention(q, k, v, tensor_layout="HND", backend=backend)
    nhd = attention(*(x.transpose(1, 2) for x in (q, k, v)), backend=backend)
    assert out.shape == q.shape
    torch.testing.assert_close(out, nhd.transpose(1, 2))
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)
    from diffusers_trtllm import run_attention

    _, result = run_attention(q, k, v, tensor_layout="HND", backend="reference", return_lse=True)
    assert result.lse.shape == (1, 8, 96)


@pytest.mark.parametrize("tensor_layout, error", [("BHSD", ValueError), ("nhd", ValueError), (None, ControlTypeError),
                                                  (2, ControlTypeError)])
def test_tensor_layout_refuses_what_is_not_a_layout(tensor_layout, error):
    q, k, v = _qkv()
    with pytest.raises(error, match=r"^tensor_layout must be 'NHD' \(\[batch, tokens, heads, head_dim\]\) or 'HND'"):
        attention(q, k, v, tensor_layout=tensor_layout, backend="reference")


def test_functional_entry_points_name_their_keywords():
    """``help(attention)`` shows what it takes: no ``**kwargs`` hides a keyword."""
    import inspect

    from diffusers_trtllm import run_attention

    for fn in (attention, run_attention):
        params = inspect.signature(fn).parameters
        assert "tensor_layout" in params and params["tensor_layout"].default == "NHD"
        assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), fn.__name__
    assert set(inspect.signature(attention).parameters) <= set(inspect.signature(run_attention).parameters)


# ---- what cannot run is refused before it runs -----------------------------------------------------

@pytest.mark.parametrize("how", ["install", "set_attn_processor"])
@pytest.mark.parametrize("kwargs, says", [
    ({"skip_softmax_threshold": 0.2}, "no CPU route for skip-softmax (role 'self')"),
    ({"quant": "int8", "roles": {"cross": "dense"}}, "no CPU route for SAGE (role 'self')"),
    ({"roles": {"joint": {"skip_softmax_threshold": 0.2, "quant": "fp8"}}}, "skip-softmax and SAGE (role 'joint')"),
    ({"backend": "triton"}, "backend='triton' (role 'self') needs CUDA"),
])
def test_without_cuda_a_request_no_route_runs_is_refused_at_install(kwargs, says, how, monkeypatch):
    """No CUDA: ``backend="auto"`` has no CPU route for skip-softmax or SAGE, a GPU route none at all; refused in
    one line, the fix first, before any layer is served (not at the first call, 75 lines deep)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model, _ = tiny_models.build("flux")
    with pytest.raises(RuntimeError) as info:
        install(model, TrtllmAttnProcessor(**kwargs)) if how == "install" else model.set_attn_processor(
            TrtllmAttnProcessor(**kwargs))
    message = str(info.value)
    assert message.startswith("Pass backend='reference'") and "\n" not in message and says in message, message
    assert not any(isinstance(p, TrtllmAttnProcessor) for p in model.attn_processors.values())


def test_without_cuda_what_runs_on_the_cpu_is_accepted(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for kwargs in ({}, {"skip_softmax_threshold": 0.2, "backend": "reference"}, {"quant": "int8", "fallback": "dense"},
                   {"skip_softmax_threshold": 0.2, "roles": {r: "dense" for r in ("self", "cross", "joint", "refiner")}}):
        model, _ = tiny_models.build("flux")
        install(model, TrtllmAttnProcessor(**kwargs))
    # Whether CUDA exists decides, not where the model is now: install on the CPU, then .to("cuda"), is a real pattern.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    install(tiny_models.build("flux")[0], TrtllmAttnProcessor(skip_softmax_threshold=0.2, quant="int8"))


def test_target_sparsity_without_a_calibration_is_refused_before_any_layer_runs():
    model, inputs = tiny_models.build("wan_t2v")
    proc = TrtllmAttnProcessor(target_sparsity=0.5, backend="reference")
    install(model, proc)  # a calibration may still come: load_calibration after install is the usual order
    with pytest.raises(ValueError) as info, torch.no_grad():
        model(**inputs)
    message = str(info.value)
    assert message.startswith("Load a calibration with load_calibration(") and "calibrate(pipe" in message
    assert "\n" not in message and "blocks.0.attn1" in message
    assert not proc.step_table(), "no layer ran"
    config = {"sparse_attention_config": {"config_groups": {"group_0": {
        "algorithm": "skip_softmax", "target_sparsity": 0.5,
        "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "coefficients": {"a": 2.0, "b": 4.0}}}}}}
    load_calibration(model, config)
    with torch.no_grad():
        model(**inputs)
    assert proc.step_table()


def test_a_forward_that_passed_the_calibration_check_does_not_exempt_a_later_processor():
    """The check before each forward is remembered until a layer changes: a new processor is checked again."""
    model, inputs = tiny_models.build("wan_t2v")
    install(model, TrtllmAttnProcessor(skip_softmax_threshold=0.2, backend="reference"))
    with torch.no_grad():
        model(**inputs)
        model(**inputs)
    proc = TrtllmAttnProcessor(target_sparsity=0.5, backend="reference")
    install(model, proc)
    with pytest.raises(ValueError, match=r"^Load a calibration with load_calibration\("), torch.no_grad():
        model(**inputs)
    assert not proc.step_table(), "no layer ran"


def test_functional_scalars_checked():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="softmax_scale must be finite and > 0"):
        attention(q, k, v, softmax_scale=-1.0)
    with pytest.raises(ValueError, match=r"timestep must be the normalized denoising timestep in \[0, 1\]"):
        attention(q, k, v, timestep=500.0)


# ---- row 13: the CLI -------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--threshold", "-1"], r"argument --threshold: skip_softmax_threshold must be finite and in \[0.0, 1.0\); got '-1'"),
        (["--backend", "foo"], r"argument --backend: invalid choice: 'foo'"),
        (["--steps", "0"], r"argument --steps: must be >= 1; got '0'"),
        (["--disabled-until-timestep", "5"], r"argument --disabled-until-timestep: .* \[0.0, 1.0\]; got '5'"),
        (["--target-sparsity", "1.5"], r"argument --target-sparsity"),
        (["--threshold", "abc"], r"argument --threshold: must be a number; got 'abc'"),
        (["--policy", "never"], r"argument --policy: invalid choice: 'never'"),
    ],
)
def test_cli_bad_arguments_are_argparse_errors(argv, needle, capsys):
    import re

    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(needle, err), err
    assert "Traceback" not in err


def test_cli_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    from diffusers_trtllm.__main__ import DEFAULT_GATE, DEFAULT_THRESHOLD

    assert f"(default: {DEFAULT_THRESHOLD})" in out and f"(default: {DEFAULT_GATE})" in out and "(default: auto)" in out


def test_cli_policy_reaches_the_processor():
    from diffusers_trtllm.__main__ import _processor

    assert _processor(parse_args([]), skip=True, sage=True, backend="auto")._role_settings["self"].policy == "auto"
    assert _processor(parse_args(["--policy", "always"]), skip=True, sage=False, backend="auto")._role_settings["self"].policy == "always"


def test_calibration_json_roundtrip_of_accepted_file(tmp_path):
    path = tmp_path / "calib.json"
    path.write_text(json.dumps(_calibration(ignore=[])))
    assert load_calibration(_model_with_processor(), path) == {"transformer": {"calibrated": 4, "ignored": 0, "uncovered": 0}}
