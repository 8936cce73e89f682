"""Every ```python block of README.md and docs/usage.md runs as written, on the CPU, with a tiny pipeline.

A block is never edited: it runs as its text stands, in a fresh namespace (a block must be whole, as a reader
copies it) and an empty working directory. What a CPU with no network cannot give is substituted, and only that:

- ``DiffusionPipeline.from_pretrained`` (so also ``FluxPipeline.from_pretrained``, ``WanPipeline.from_pretrained``,
  ...) returns the tiny offline pipeline of the family the class or the model id names (``tests/tiny_models.py``):
  tests download nothing, and a real id names a checkpoint of many GB. Its ``.to(...)`` keeps it on the CPU in
  float32 (no CUDA here; ``torch_dtype`` is ignored alike), and its call takes the tiny family's prompt embeddings
  for the prompt (it has no text encoder), its own height, width, frame count and guidance, and at most 2 steps.
- ``TrtllmAttnProcessor(backend="auto")`` and ``attention``/``run_attention`` with ``backend="auto"`` run the
  ``reference`` route: on a CPU ``auto`` has no route for skip-softmax or SAGE, and the reference computes what
  the GPU kernels compute.
- ``diffusers.utils.export_to_video`` records the frames instead of writing a video (that needs imageio and
  ffmpeg, which the tests do not install).

``bash`` and other blocks are not run. A python block that cannot run on a CPU at all (``torchrun`` over
several GPUs) is skipped by an HTML comment on the line just before its fence, giving the reason:
``<!-- docs-test: skip (needs torchrun and two GPUs) -->``. A failure names the file and line of the block, and
its traceback the file's own line numbers.
"""

from __future__ import annotations

import functools

import re
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/usage.md")
_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((.+)\)\s*-->")


def python_blocks(relative: str) -> list[tuple[int, str, str | None]]:
    """``(line of the first code line, code, skip reason or None)`` for each ```python block of a file."""
    lines = (ROOT / relative).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening or not opening.group(2):
            i += 1
            continue
        indent, language, start = opening.group(1), opening.group(2), i + 1
        end = start
        while end < len(lines) and not re.match(r"^\s*```\s*$", lines[end]):
            end += 1
        if end == len(lines):
            raise AssertionError(f"{relative}:{i + 1}: a ``` fence that is never closed")
        if language == "python":
            skip = _SKIP.search(lines[i - 1]) if i else None
            code = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[start:end])
            blocks.append((start + 1, code, skip.group(1) if skip else None))
        i = end + 1
    return blocks


def _cases() -> list[Any]:
    return [pytest.param(name, line, code, skip, id=f"{name}:{line}")
            for name in DOCS for line, code, skip in python_blocks(name)]


# ---- the substitutes ---------------------------------------------------------------------------
_FAMILY_OF_CLASS = {"FluxPipeline": "flux", "WanPipeline": "wan", "StableDiffusion3Pipeline": "sd3"}
_FAMILY_IN_ID = (("flux", "flux"), ("wan", "wan"), ("stable-diffusion-3", "sd3"), ("sd3", "sd3"))


def _family(cls: type, model_id: Any) -> str:
    if cls.__name__ in _FAMILY_OF_CLASS:
        return _FAMILY_OF_CLASS[cls.__name__]
    for key, family in _FAMILY_IN_ID:
        if key in str(model_id).lower():
            return family
    raise AssertionError(f"no tiny offline pipeline for {cls.__name__}.from_pretrained({model_id!r}): add the family "
                         "to tests/test_docs_code_blocks.py (_FAMILY_OF_CLASS, _FAMILY_IN_ID, _offline_pipeline)")


def _offline_pipeline(family: str, model_id: Any) -> Any:
    """The tiny pipeline of a family, its calls fed the tiny inputs (see the module docstring); Wan 2.2's two experts."""
    import tiny_models

    if family == "wan":
        pipe, tiny_inputs = tiny_models.wan_pipeline(two_experts="2.2" in str(model_id))
    else:
        pipe, tiny_inputs = {"flux": tiny_models.flux_pipeline, "sd3": tiny_models.sd3_pipeline}[family]()
    tiny_inputs.pop("output_type")  # the block's own output type: images, video frames
    stock = type(pipe)

    class Offline(stock):
        def to(self, *args: Any, **kwargs: Any) -> Any:
            return self

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            for name in ("prompt", "negative_prompt", "prompt_2", "prompt_3", "generator"):
                kwargs.pop(name, None)
            kwargs.update(tiny_inputs)
            kwargs["num_inference_steps"] = min(int(kwargs.get("num_inference_steps", 2)), 2)
            return stock.__call__(self, **kwargs)

    Offline.__name__ = Offline.__qualname__ = stock.__name__
    pipe.__class__ = Offline
    return pipe


def _with_reference_backend(function: Callable) -> Callable:
    """``function`` with ``backend="auto"`` made ``"reference"`` (its signature kept: a setting records it)."""
    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("backend", "auto") == "auto":
            kwargs["backend"] = "reference"
        return function(*args, **kwargs)
    return call


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list:
    """The substitutes in place; returns the list ``export_to_video`` records its calls in."""
    import diffusers
    import diffusers.utils

    import diffusers_trtllm
    from diffusers_trtllm import TrtllmAttnProcessor

    def from_pretrained(cls: type, model_id: Any = None, *args: Any, **kwargs: Any) -> Any:
        return _offline_pipeline(_family(cls, model_id), model_id)

    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", classmethod(from_pretrained))
    monkeypatch.setattr(TrtllmAttnProcessor, "__init__", _with_reference_backend(TrtllmAttnProcessor.__init__))
    for name in ("attention", "run_attention"):
        monkeypatch.setattr(diffusers_trtllm, name, _with_reference_backend(getattr(diffusers_trtllm, name)))
    videos: list = []
    monkeypatch.setattr(diffusers.utils, "export_to_video", lambda frames, path=None, **kw: videos.append(path) or path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    return videos


@pytest.mark.parametrize("name, line, code, skip", _cases())
def test_python_block_runs_as_written(offline: list, name: str, line: int, code: str, skip: str | None) -> None:
    if skip:
        pytest.skip(f"{name}:{line}: {skip}")
    # Padding to the block's line makes the traceback name the document's own lines.
    compiled = compile("\n" * (line - 1) + code, str(ROOT / name), "exec")
    try:
        exec(compiled, {"__name__": "__docs_block__"})
    except Exception as error:
        raise AssertionError(f"{name}:{line}: the python block starting here failed: "
                             f"{type(error).__name__}: {error}") from error


def test_every_document_has_python_blocks() -> None:
    """The parser finds the blocks (a renamed fence would otherwise leave nothing tested)."""
    for name in DOCS:
        assert python_blocks(name), f"{name}: no ```python block found"
