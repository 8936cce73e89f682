"""``python -m diffusers_trtllm card`` end to end on the CPU (the tiny offline pipeline, 2 prompts; 1 seed and 2 steps
here to keep the suite fast, docs/model_card.md times the 2-seed run): the folder holds the setting, images and a
README.md that ``huggingface_hub.ModelCard.load`` reads with its metadata; ``--push-to-hub`` hands ``upload_folder``
that folder (mocked: no Hub is reachable here)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from diffusers_trtllm import TrtllmAttnProcessor
from diffusers_trtllm.__main__ import main
from diffusers_trtllm.card import NOISE_NOTE, TINY_MODEL_ID, kernel_credits
from diffusers_trtllm.setting import SETTING_FILE


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("A cat holding a sign that says hello world\n\nA lighthouse on a cliff at dusk\n")
    return str(path)


def test_card_writes_a_folder_the_hub_reads(tmp_path, prompts, monkeypatch):
    import diffusers.configuration_utils as configuration_utils
    import diffusers.utils.hub_utils as hub_utils
    from huggingface_hub import ModelCard

    uploads = []
    monkeypatch.setattr(configuration_utils, "create_repo", lambda repo_id, **kw: SimpleNamespace(repo_id=repo_id))
    monkeypatch.setattr(hub_utils, "upload_folder",
                        lambda **kw: uploads.append({**kw, "files": sorted(os.listdir(kw["folder_path"]))}))
    out = tmp_path / "card"
    main(["card", "--prompts", prompts, "--seeds", "1", "--steps", "2", "--quant", "int8", "--out", str(out),
          "--push-to-hub", "someuser/tiny-flux-trtllm"])
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "diffusers-trtllm" and data["base_model"] == TINY_MODEL_ID
    assert data["pipeline_tag"] == "text-to-image" and data["license"] == "apache-2.0"
    assert {"diffusers", "skip-softmax", "sage-attention", "tiny-random"} <= set(data["tags"])
    text = card.text
    assert NOISE_NOTE in text and "not a speed" in text
    assert 'TrtllmAttnProcessor.from_pretrained("someuser/tiny-flux-trtllm")' in text
    assert "https://github.com/diffusers-trtllm/diffusers-trtllm" in text  # from the installed package's metadata
    assert kernel_credits({"reference"})[0] in text and "sage-sm90" not in text  # only the routes that ran
    assert text.count("| A ") == 2 and "PSNR" in text and "SSIM" in text
    for name in ("images/prompt_0.png", "images/prompt_1.png", "sparsity.png", SETTING_FILE):
        assert (out / name).is_file() and (out / name).stat().st_size < 100_000
    proc = TrtllmAttnProcessor.from_pretrained(out)
    assert proc._role_settings["self"].quant.dtype_qk == "int8" and proc._role_settings["self"].skip.target_sparsity == 0.5
    assert json.loads((out / SETTING_FILE).read_text())["calibration"]["transformer"]["model_class"] == \
        "FluxTransformer2DModel"
    (upload,) = uploads
    assert upload["repo_id"] == "someuser/tiny-flux-trtllm" and upload["folder_path"] == str(out)
    assert upload["files"] == ["README.md", "images", "sparsity.png", SETTING_FILE]


@pytest.mark.parametrize("argv, message", [
    (["--out", "x"], "the following arguments are required: --prompts"),
    (["--prompts", "/nonexistent.txt", "--out", "x"], "argument --prompts: '/nonexistent.txt' is not a file"),
    (["--push-to-hub", "not a repo"], "argument --push-to-hub"),
    (["--seeds", "0"], "argument --seeds"),
    (["--target-sparsity", "1.5"], "argument --target-sparsity"),
])
def test_card_arguments_are_checked_before_any_model_is_built(prompts, tmp_path, capsys, argv, message):
    if "--prompts" not in argv and "--out" in argv:
        pass
    elif "--prompts" not in argv:
        argv = ["--prompts", prompts, "--out", str(tmp_path / "card"), *argv]
    with pytest.raises(SystemExit) as exit_:
        main(["card", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "card").exists()
