"""A setting saved with ``save_pretrained`` and loaded with ``from_pretrained`` / ``load_calibration``: from a folder,
from a Hugging Face cache laid out as ``huggingface_hub`` lays it (offline), and every bad file refused in one line
with the pipeline left as it was. No Hub is reachable here: uploads are checked against a mocked ``upload_folder``."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil

import pytest
import torch

import tiny_models
from diffusers_trtllm import TrtllmAttnProcessor, calibrate, install, load_calibration
from diffusers_trtllm.demo import build_demo_pipeline
from diffusers_trtllm.serving.layer import layer_of
from diffusers_trtllm.setting import FORMAT_VERSION, SETTING_FILE, SettingFileError

#: A value other than the default for every constructor argument (a new argument must be added here: the test below
#: fails until it is, so that none goes unsaved).
EXAMPLES = {
    "skip_softmax_threshold": 0.07,
    "target_sparsity": 0.45,
    "disabled_until_timestep": 0.8,
    "quant": {"dtype_qk": "int8", "q_block_size": 4, "k_block_size": 16},
    "backend": "reference",
    "fallback": "dense",
    "roles": {"cross": "dense", "joint": {"quant": None, "skip_softmax_threshold": 0.1}, "refiner": "stock"},
    "collect_stats": True,
    "policy": "always",
    "fused_rotary": False,
    "fused_qk_norm": True,
}
#: Arguments that exclude each other: each example runs without the others.
EXCLUSIVE = ("skip_softmax_threshold", "target_sparsity")


def _arguments(proc) -> dict:
    return proc._arguments


def _parameters() -> list[str]:
    return [p for p in inspect.signature(TrtllmAttnProcessor.__init__).parameters if p != "self"]


def _calibrated_demo(seed: int = 0):
    """The tiny offline Flux pipeline with a processor installed and calibrated (2 steps)."""
    pipe, inputs = build_demo_pipeline(seed)
    pipe.set_progress_bar_config(disable=True)
    embeds = {k: inputs[k] for k in ("prompt_embeds", "pooled_prompt_embeds")}
    cal = calibrate(pipe, [embeds], steps=2, height=64, width=64, fit_range=(0.05, 0.95), target_sparsity=0.3,
                    disabled_until_timestep=0.9)
    proc = TrtllmAttnProcessor(target_sparsity=0.4, quant={"dtype_qk": "int8"}, backend="reference",
                               roles={"joint": {"quant": None}})
    install(pipe, proc)
    load_calibration(pipe, cal)
    return pipe, inputs, proc


def _run(pipe, inputs) -> torch.Tensor:
    out = pipe(**inputs, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="latent")
    return out.images


def _layers(pipe) -> dict:
    return {name: (layer_of(m).calibration, layer_of(m).ignored) for name, m in pipe.transformer.named_modules()
            if layer_of(m) is not None}


def _processors(pipe) -> dict:
    return {name: proc for name, proc in pipe.transformer.attn_processors.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A calibrated demo pipeline, its processor and the folder save_pretrained wrote."""
    pipe, inputs, proc = _calibrated_demo()
    folder = tmp_path_factory.mktemp("setting")
    proc.save_pretrained(folder)
    return pipe, inputs, proc, folder


# ---- every argument round-trips -------------------------------------------------------------------------------------
def test_every_constructor_argument_has_an_example():
    missing = [p for p in _parameters() if p not in EXAMPLES]
    assert not missing, f"add a non-default example of {missing} to EXAMPLES so that save_pretrained is tested on it"


@pytest.mark.parametrize("name", _parameters())
def test_every_constructor_argument_round_trips(tmp_path, name):
    kwargs = {k: v for k, v in EXAMPLES.items() if k in _parameters() and (k == name or k not in EXCLUSIVE)}
    proc = TrtllmAttnProcessor(**kwargs)
    proc.save_pretrained(tmp_path)
    written = json.loads((tmp_path / SETTING_FILE).read_text())
    assert written[name] == kwargs[name] and written["format_version"] == FORMAT_VERSION
    loaded = TrtllmAttnProcessor.from_pretrained(tmp_path)
    assert _arguments(loaded) == _arguments(proc)
    for role in ("self", "cross", "joint", "refiner"):
        assert loaded._role_settings[role] == proc._role_settings[role]
    assert loaded.collect_stats == proc.collect_stats


def test_the_processor_adds_only_the_three_hub_methods_to_its_public_names():
    from diffusers.utils import PushToHubMixin

    ours = {n for n in dir(TrtllmAttnProcessor) if not n.startswith("_")} & (
        {n for n in dir(PushToHubMixin) if not n.startswith("_")} | {"save_pretrained", "from_pretrained", "config"})
    assert ours == {"save_pretrained", "from_pretrained", "push_to_hub"}


def test_a_quant_config_and_a_dtype_are_saved_as_json(tmp_path):
    from diffusers_trtllm import QuantConfig

    proc = TrtllmAttnProcessor(quant=QuantConfig(dtype_qk=torch.int8, k_block_size=128), roles={"cross": {"quant": "fp8"}})
    proc.save_pretrained(tmp_path)
    loaded = TrtllmAttnProcessor.from_pretrained(tmp_path)
    assert loaded._role_settings["self"].quant == proc._role_settings["self"].quant and loaded._role_settings["cross"] == proc._role_settings["cross"]


def test_keyword_arguments_override_the_file(saved):
    _, _, _, folder = saved
    loaded = TrtllmAttnProcessor.from_pretrained(folder, quant=None)
    assert loaded._role_settings["self"].quant is None and loaded._role_settings["self"].skip.target_sparsity == 0.4
    with pytest.raises(TypeError, match=r"from_pretrained has unknown keyword arguments 'qaunt' \(did you mean 'quant'\?\)"):
        TrtllmAttnProcessor.from_pretrained(folder, qaunt=None)


# ---- the same calibration and output -------------------------------------------------------------------------------
def test_a_saved_setting_gives_the_same_calibration_and_output(saved):
    pipe, inputs, proc, folder = saved
    before_layers, before = _layers(pipe), _run(pipe, inputs)
    assert all(cal is not None for cal, _ in before_layers.values())
    fresh, fresh_inputs = build_demo_pipeline(0)
    fresh.set_progress_bar_config(disable=True)
    loaded = TrtllmAttnProcessor.from_pretrained(folder)
    install(fresh, loaded)  # the two lines a user writes
    assert _layers(fresh) == before_layers
    assert torch.equal(_run(fresh, fresh_inputs), before)
    # load_calibration reads the folder too
    other = TrtllmAttnProcessor(target_sparsity=0.4, quant={"dtype_qk": "int8"}, backend="reference",
                                roles={"joint": {"quant": None}})
    install(fresh, other)
    assert load_calibration(fresh, folder) == {"transformer": {"calibrated": 2, "ignored": 0, "uncovered": 0}}
    assert torch.equal(_run(fresh, fresh_inputs), before)


def test_ignore_patterns_survive_the_round_trip(tmp_path):
    model, _ = tiny_models.build("wan_t2v")
    proc = TrtllmAttnProcessor(target_sparsity=0.5, backend="reference")
    install(model, proc)
    group = {"algorithm": "skip_softmax", "ignore": ["blocks.1.*"],
             "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "coefficients": {"a": 5.0, "b": 2.0}}}
    load_calibration(model, {"sparse_attention_config": {"config_groups": {"g": group}}})
    proc.save_pretrained(tmp_path)
    fresh, _ = tiny_models.build("wan_t2v")
    install(fresh, TrtllmAttnProcessor.from_pretrained(tmp_path))
    assert [layer_of(fresh.blocks[i].attn1).ignored for i in (0, 1)] == [False, True]
    assert layer_of(fresh.blocks[0].attn2).calibration == layer_of(model.blocks[0].attn2).calibration


# ---- the Hub: a cache as huggingface_hub lays it, offline -----------------------------------------------------------
def _hub_cache(cache, repo_id: str, files: dict[str, bytes], commit: str, refs: tuple[str, ...] = ("main",)) -> None:
    """``models--{org}--{name}/{blobs,refs,snapshots/<commit>/...}`` as a user's earlier download left it."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True)
    (root / "refs").mkdir()
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    for path, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        target = root / "snapshots" / commit / path
        target.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, target.parent), target)


@pytest.fixture
def offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_a_repo_id_loads_offline_from_the_cache_with_subfolder_and_revision(saved, tmp_path, offline):
    pipe, inputs, proc, folder = saved
    data = (folder / SETTING_FILE).read_bytes()
    commit = "a" * 40
    _hub_cache(tmp_path, "someuser/flux-trtllm", {f"flux/{SETTING_FILE}": data}, commit, refs=("main", "v1"))
    for revision in (None, "v1", commit):
        loaded = TrtllmAttnProcessor.from_pretrained("someuser/flux-trtllm", subfolder="flux", revision=revision,
                                                     cache_dir=tmp_path)
        assert _arguments(loaded) == _arguments(proc)
    fresh, fresh_inputs = build_demo_pipeline(0)
    fresh.set_progress_bar_config(disable=True)
    install(fresh, loaded)
    assert _layers(fresh) == _layers(pipe)
    install(fresh, TrtllmAttnProcessor(target_sparsity=0.4, backend="reference"))
    summary = load_calibration(fresh, "someuser/flux-trtllm", subfolder="flux", cache_dir=tmp_path)
    assert summary["transformer"]["calibrated"] == 2 and _layers(fresh) == _layers(pipe)


@pytest.mark.parametrize("call", ["from_pretrained", "load_calibration"])
def test_a_repo_id_not_in_the_cache_is_one_line_saying_offline(tmp_path, offline, call):
    pipe, _ = build_demo_pipeline(0)
    install(pipe, TrtllmAttnProcessor(backend="reference"))
    before = _processors(pipe)
    with pytest.raises(SettingFileError) as err:
        if call == "from_pretrained":
            TrtllmAttnProcessor.from_pretrained("someuser/not-downloaded", cache_dir=tmp_path)
        else:
            load_calibration(pipe, "someuser/not-downloaded", cache_dir=tmp_path)
    line = str(err.value)
    assert "\n" not in line and "someuser/not-downloaded" in line and "offline" in line and "HF_HUB_OFFLINE" in line
    assert str(tmp_path) in line  # the cache it looked in
    assert _processors(pipe) == before


def test_a_revision_not_in_the_cache_names_it(saved, tmp_path, offline):
    _, _, _, folder = saved
    _hub_cache(tmp_path, "someuser/flux-trtllm", {SETTING_FILE: (folder / SETTING_FILE).read_bytes()}, "b" * 40)
    with pytest.raises(SettingFileError, match=r"someuser/flux-trtllm/trtllm_attention.json@v9 .*offline"):
        TrtllmAttnProcessor.from_pretrained("someuser/flux-trtllm", revision="v9", cache_dir=tmp_path)


# ---- uploads (no Hub here: upload_folder is mocked) ----------------------------------------------------------------
def test_save_pretrained_push_to_hub_hands_upload_folder_the_folder(saved, tmp_path, monkeypatch):
    from types import SimpleNamespace

    import diffusers.configuration_utils as configuration_utils
    import diffusers.utils.hub_utils as hub_utils

    _, _, proc, _ = saved
    calls = {}
    monkeypatch.setattr(configuration_utils, "create_repo",
                        lambda repo_id, **kw: calls.setdefault("create_repo", (repo_id, kw)) and SimpleNamespace(repo_id=repo_id))
    monkeypatch.setattr(hub_utils, "upload_folder", lambda **kw: calls.setdefault("upload_folder", kw) and "commit-url")
    proc.save_pretrained(tmp_path / "out", push_to_hub=True, repo_id="someuser/flux-trtllm", token="hf_x",
                         commit_message="a setting", private=True, subfolder="flux")
    assert calls["create_repo"] == ("someuser/flux-trtllm", {"exist_ok": True, "private": True, "token": "hf_x"})
    upload = calls["upload_folder"]
    assert upload == {"repo_id": "someuser/flux-trtllm", "folder_path": str(tmp_path / "out"), "token": "hf_x",
                      "commit_message": "a setting", "create_pr": False, "path_in_repo": "flux"}
    assert os.listdir(upload["folder_path"]) == [SETTING_FILE]


def test_push_to_hub_uploads_the_setting(saved, monkeypatch):
    from types import SimpleNamespace

    import diffusers.utils.hub_utils as hub_utils

    _, _, proc, _ = saved
    uploaded = {}

    def upload_folder(**kw):
        uploaded.update(kw, files=sorted(os.listdir(kw["folder_path"])),
                        setting=json.loads(open(os.path.join(kw["folder_path"], SETTING_FILE)).read()))
        return "commit-url"

    monkeypatch.setattr(hub_utils, "create_repo", lambda repo_id, **kw: SimpleNamespace(repo_id=repo_id))
    monkeypatch.setattr(hub_utils, "load_or_create_model_card", lambda repo_id, **kw: hub_utils.ModelCard("card"))
    monkeypatch.setattr(hub_utils, "upload_folder", upload_folder)
    assert proc.push_to_hub("someuser/flux-trtllm", token="hf_x") == "commit-url"
    assert uploaded["repo_id"] == "someuser/flux-trtllm" and uploaded["files"] == ["README.md", SETTING_FILE]
    assert uploaded["setting"]["calibration"]["transformer"]["layers"] == [
        "transformer_blocks.0.attn", "single_transformer_blocks.0.attn"]


# ---- bad files: one line naming the file and the field, the pipeline as it was ---------------------------------------
def _edit(folder, tmp_path, change) -> str:
    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    path = out / SETTING_FILE
    change(path)
    return str(out)


def _json_edit(update):
    def change(path):
        data = json.loads(path.read_text())
        update(data)
        path.write_text(json.dumps(data))
    return change


BAD = {
    "missing": (lambda p: p.unlink(), r"(trtllm_attention.json does not exist|holds neither trtllm_attention.json)"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:200]), r"trtllm_attention.json is not valid UTF-8 JSON"),
    "not an object": (lambda p: p.write_text("[1, 2]"), r"holds list"),
    "foreign class": (_json_edit(lambda d: d.update(_class_name="FluxTransformer2DModel")), r"field '_class_name' is 'Flux"),
    "no class": (_json_edit(lambda d: d.pop("_class_name")), r"field '_class_name' is missing"),
    "newer format": (_json_edit(lambda d: d.update(format_version=FORMAT_VERSION + 1)),
                     r"field 'format_version' is 2, written by a newer diffusers-trtllm"),
    "no format": (_json_edit(lambda d: d.pop("format_version")), r"field 'format_version' is missing"),
    "unknown argument": (_json_edit(lambda d: d.update(sparsity_mode="fast")), r"field 'sparsity_mode' is not an argument"),
    "bad quant": (_json_edit(lambda d: d.update(quant={"dtype_qk": "int4"})), r"field 'quant' is refused: quant.dtype_qk"),
    "bad threshold": (_json_edit(lambda d: d.update(target_sparsity=None, skip_softmax_threshold=2)),
                      r"field 'skip_softmax_threshold' is refused"),
    "layers not a list": (_json_edit(lambda d: d["calibration"]["transformer"].update(layers="all")),
                          r"field 'calibration.transformer.layers' must be a non-empty list"),
    "no layers": (_json_edit(lambda d: d["calibration"]["transformer"].pop("layers")),
                  r"field 'calibration.transformer.layers' is missing"),
    "bad curve": (_json_edit(lambda d: d["calibration"]["transformer"]["sparse_attention_config"]["config_groups"]
                             ["group_0"]["threshold_scale_factor"].update(coefficients={"a": "x", "b": 1}, prefill=None)),
                  r"field 'calibration.transformer.sparse_attention_config' is malformed"),
    "another model": (_json_edit(lambda d: d["calibration"]["transformer"].update(
        model_class="WanTransformer3DModel", layers=["blocks.0.attn1", "blocks.0.attn2"])),
        r"field 'calibration.transformer.layers' names the 2 attention layers of a WanTransformer3DModel, and "
        r"transformer here is a FluxTransformer2DModel whose layers differ"),
    "another pipeline": (_json_edit(lambda d: d.update(calibration={"transformer_2": d["calibration"]["transformer"]})),
                         r"field 'calibration' has sections for transformer_2"),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("call", ["from_pretrained + install", "load_calibration"])
def test_a_bad_setting_is_one_line_and_leaves_the_pipeline_as_it_was(saved, tmp_path, case, call):
    pipe, inputs, proc, folder = saved
    change, message = BAD[case]
    edited = _edit(folder, tmp_path, change)
    processors, layers = _processors(pipe), _layers(pipe)
    with pytest.raises(ValueError, match=message) as err:
        if call == "load_calibration":
            load_calibration(pipe, edited)
        else:
            install(pipe, TrtllmAttnProcessor.from_pretrained(edited))
    line = str(err.value)
    assert "\n" not in line and (edited in line or "bad quant" in case or "threshold" in case)
    assert _processors(pipe) == processors and _layers(pipe) == layers


def test_set_attn_processor_alone_gives_the_layers_the_saved_calibration(saved):
    """The Diffusers one-liner with a loaded setting: its calibration reaches the layers as install's does."""
    pipe, inputs, _, folder = saved
    before_layers, before = _layers(pipe), _run(pipe, inputs)
    fresh, fresh_inputs = build_demo_pipeline(0)
    fresh.set_progress_bar_config(disable=True)
    fresh.transformer.set_attn_processor(TrtllmAttnProcessor.from_pretrained(folder))
    assert _layers(fresh) == before_layers
    assert torch.equal(_run(fresh, fresh_inputs), before)


@pytest.mark.parametrize("attach", [install, lambda pipe, proc: pipe.transformer.set_attn_processor(proc)],
                         ids=["install", "set_attn_processor"])
def test_a_setting_for_another_model_class_is_refused_before_any_change(saved, attach):
    _, _, _, folder = saved
    pipe, _ = tiny_models.wan_pipeline()
    before = _processors(pipe)
    with pytest.raises(SettingFileError, match=r"field 'calibration.transformer.layers' names the 2 attention layers "
                                               r"of a FluxTransformer2DModel, and transformer here is a WanTransformer3DModel"):
        attach(pipe, TrtllmAttnProcessor.from_pretrained(folder))
    assert _processors(pipe) == before and all(layer_of(m) is None for m in pipe.transformer.modules())


def test_a_curve_that_does_not_cover_a_layer_leaves_every_layer_as_it_was(saved):
    pipe, _, _, _ = saved
    layers = _layers(pipe)
    only_one = {"sparse_attention_config": {"config_groups": {"g": {
        "targets": ["transformer_blocks.*"],
        "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "coefficients": {"a": 9.0, "b": 1.0}}}}}}
    with pytest.raises(ValueError, match="no calibration curve covers transformer.single_transformer_blocks.0.attn"):
        load_calibration(pipe, only_one)
    assert _layers(pipe) == layers  # the first layer did not take the new curve either


def test_a_processor_whose_layers_came_calibrated_asks_for_load_calibration(saved, tmp_path):
    pipe, _, proc, _ = saved
    successor = TrtllmAttnProcessor(target_sparsity=0.4, backend="reference")
    install(pipe, successor)  # the layers keep their curves (take_over), which successor was never given
    with pytest.raises(ValueError, match=r"call load_calibration\(pipe, \.\.\.\) with this processor installed"):
        successor.save_pretrained(tmp_path)
    install(pipe, proc)


def _curve(a: float, b: float, **group) -> dict:
    return {"sparse_attention_config": {"config_groups": {"g": {
        "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "coefficients": {"a": a, "b": b}},
        **group}}}}


def test_wan22_two_experts_round_trip_with_their_own_curves(tmp_path):
    """Two denoisers with layers of the same names: each keeps its own section and curve."""
    pipe, inputs = tiny_models.wan_pipeline(two_experts=True)
    proc = TrtllmAttnProcessor(skip_softmax_threshold=None, target_sparsity=0.3, backend="reference")
    install(pipe, proc)
    load_calibration(pipe, {"transformer": _curve(3.0, 2.0), "transformer_2": _curve(5.0, 1.0, ignore=["blocks.1.*"])})
    before = pipe(**inputs, num_inference_steps=2, generator=torch.Generator().manual_seed(0)).frames
    proc.save_pretrained(tmp_path)
    assert set(json.loads((tmp_path / SETTING_FILE).read_text())["calibration"]) == {"transformer", "transformer_2"}
    fresh, fresh_inputs = tiny_models.wan_pipeline(two_experts=True)
    install(fresh, TrtllmAttnProcessor.from_pretrained(tmp_path))
    for expert in ("transformer", "transformer_2"):
        old, new = getattr(pipe, expert), getattr(fresh, expert)
        assert [(layer_of(m).calibration, layer_of(m).ignored) for m in new.modules() if layer_of(m)] == \
               [(layer_of(m).calibration, layer_of(m).ignored) for m in old.modules() if layer_of(m)]
    after = fresh(**fresh_inputs, num_inference_steps=2, generator=torch.Generator().manual_seed(0)).frames
    assert torch.equal(after, before)
    other, _ = tiny_models.wan_pipeline(two_experts=True)  # one expert's one-liner: both sections fit its layers
    with pytest.raises(ValueError, match=r"sections for transformer, transformer_2, each made for this "
                                         r"WanTransformer3DModel's layers; install\(pipe, proc\) gives each"):
        other.transformer_2.set_attn_processor(TrtllmAttnProcessor.from_pretrained(tmp_path))
    single, _ = tiny_models.wan_pipeline()  # one expert: the file's transformer_2 section has no denoiser here
    with pytest.raises(SettingFileError, match=r"field 'calibration' has sections for transformer, transformer_2, and "
                                               r"the pipeline's denoisers are transformer"):
        install(single, TrtllmAttnProcessor.from_pretrained(tmp_path))


def test_local_files_only_names_itself_when_the_repo_is_not_cached(tmp_path):
    with pytest.raises(SettingFileError, match=r"someuser/not-downloaded/trtllm_attention.json is not in the Hugging "
                                               r"Face cache .* offline \(local_files_only=True\)"):
        TrtllmAttnProcessor.from_pretrained("someuser/not-downloaded", cache_dir=tmp_path, local_files_only=True)
