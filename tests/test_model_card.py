"""docs/model_card.md's Python snippet runs against a checkpoint folder carrying a sparse_attention_config.

The checkpoint is the tiny offline Flux pipeline (local attention, random weights) with tiny text
encoders and word-level tokenizers built in code, calibrated with ``calibrate`` and saved with
``save_pretrained`` + ``save_calibration``. The snippet runs as written except for what a CPU needs,
each substitution named below.
"""

from __future__ import annotations

import os
import re

import torch

from diffusers_trtllm import TrtllmAttnProcessor, calibrate, save_calibration
from diffusers_trtllm.demo import build_demo_pipeline
from diffusers_trtllm.serving.layer import layer_of
from test_docs_code_blocks import _with_reference_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: (text in the card, what the CPU test runs instead)
SUBSTITUTIONS = (
    ('"MODEL_ID"', None),  # -> the checkpoint folder
    ('device, dtype = "cuda", torch.bfloat16', 'device, dtype = "cpu", torch.float32'),
    ("TrtllmAttnProcessor(", 'TrtllmAttnProcessor(backend="reference", collect_stats=True,'),  # the CPU oracle route
    ("num_inference_steps=28", "num_inference_steps=3, height=64, width=64, max_sequence_length=16"),
)


def _tokenizer(max_length: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2}
    for word in "a photo of an astronaut riding horse".split():
        vocab[word] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>",
                                   model_max_length=max_length)


def _checkpoint(folder: str) -> None:
    from diffusers import FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    pipe, inputs = build_demo_pipeline()
    pipe.set_progress_bar_config(disable=True)
    embeds = {k: inputs[k] for k in ("prompt_embeds", "pooled_prompt_embeds")}
    cal = calibrate(pipe, [embeds], steps=3, height=64, width=64, fit_range=(0.05, 0.95), target_sparsity=0.3,
                    disabled_until_timestep=0.9)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=16, hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                        num_attention_heads=4, max_position_embeddings=77, projection_dim=32))
    t5 = T5EncoderModel(T5Config(vocab_size=16, d_model=32, d_ff=37, d_kv=8, num_layers=1, num_heads=4))
    full = FluxPipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=clip.eval(), tokenizer=_tokenizer(77),
                        text_encoder_2=t5.eval(), tokenizer_2=_tokenizer(16), transformer=pipe.transformer)
    full.save_pretrained(folder)
    save_calibration(cal, folder)  # into transformer/config.json


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_guide_publishes_and_loads_a_setting_as_written(tmp_path, monkeypatch):
    """docs/model_card.md's Publish and Load blocks on the CPU (the tiny offline pipeline), with ``backend="auto"``
    made the reference as in tests/test_docs_code_blocks.py (a CPU has no route of ``auto`` for skip or SAGE)."""
    monkeypatch.setattr(TrtllmAttnProcessor, "__init__", _with_reference_backend(TrtllmAttnProcessor.__init__))
    card = open(os.path.join(ROOT, "docs", "model_card.md"), encoding="utf-8").read()
    publish, load = [block for block in _python_blocks(card) if "MODEL_ID" not in block]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(publish, "docs/model_card.md (publish)", "exec"), scope)
    saved = [layer_of(m).calibration for m in scope["pipe"].transformer.modules() if layer_of(m) is not None]
    exec(compile(load, "docs/model_card.md (load)", "exec"), scope)
    loaded = [layer_of(m) for m in scope["pipe"].transformer.modules() if layer_of(m) is not None]
    assert all(cal is not None for cal in saved) and [s.calibration for s in loaded] == saved
    assert loaded[0].processor is not scope["proc"] and loaded[0].processor._role_settings["self"].quant.dtype_qk == "int8"


def test_model_card_snippet_runs_against_a_local_checkpoint(tmp_path, capsys):
    folder = str(tmp_path / "checkpoint")
    _checkpoint(folder)
    card = open(os.path.join(ROOT, "docs", "model_card.md"), encoding="utf-8").read()
    (snippet,) = [block for block in _python_blocks(card) if "MODEL_ID" in block]
    for text, replacement in SUBSTITUTIONS:
        assert text in snippet, f"the card's snippet no longer contains {text!r}; update this test"
        snippet = snippet.replace(text, repr(folder) if replacement is None else replacement)
    scope: dict = {}
    exec(compile(snippet, "docs/model_card.md", "exec"), scope)
    proc, pipe = scope["proc"], scope["pipe"]
    layers = [layer_of(m) for m in pipe.transformer.modules() if layer_of(m) is not None]
    assert layers and all(s.calibration is not None for s in layers)  # read from the checkpoint's config.json
    rows = proc.summary()
    assert any(r["attention"] == "sparse" and r["skipped_fraction"] > 0 for r in rows)
    assert any(r["attention"] == "dense (gated)" for r in rows)  # t = 1 > 0.9, the user's gate
    assert {r["gate_source"] for r in rows} == {"user"}
    assert "sparse" in capsys.readouterr().out
