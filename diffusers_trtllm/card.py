"""A setting's model card: ``python -m diffusers_trtllm card`` (the guide: docs/model_card.md).

:func:`make_card` calibrates a pipeline (or takes a calibration), runs it dense (the model's own attention) and
with the setting on the same prompts and seeds, and writes a folder ready for the Hub: the setting
(``save_pretrained``'s ``trtllm_attention.json``), a ``README.md`` model card whose metadata is
``huggingface_hub``'s ``ModelCardData``, side-by-side images (the first frame of a video), the skipped-tile
fraction per layer and step (``proc.plot``), the measured speed and the quality against dense per prompt (PSNR
and SSIM from torchmetrics; LPIPS where the ``lpips`` package is installed). Without ``--model`` it runs the
demo's tiny offline pipeline on the CPU: random weights (its images are noise, and the card says so) and the
reference route (its times are no speed, and the card says so too).
"""

from __future__ import annotations

import importlib.metadata
import json
import importlib.util
import math
import os
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

from .version import __version__

__all__ = ["TINY_MODEL_ID", "CardRuns", "make_card", "repository_url", "kernel_credits", "quality", "METRICS_EXTRA"]

#: What ``--model`` names the demo's tiny offline pipeline (``demo.build_demo_pipeline``): not a Hub repo.
TINY_MODEL_ID = "diffusers-trtllm/tiny-flux-offline"
#: The extra that installs what the card measures with.
METRICS_EXTRA = "card"
#: Who wrote each route's kernel, as the card credits it (only the routes that ran are named).
KERNELS = {
    "sage-sm90": "`sage-sm90`: diffusers-trtllm's own CUDA kernel (SAGE int8 Q/K with skip-softmax, Hopper)",
    "fa3": "`fa3`: FlashInfer's FlashAttention-3 prefill kernels (dense, Hopper)",
    "trtllm-gen": "`trtllm-gen`: TensorRT-LLM's kernels through FlashInfer (Blackwell)",
    "fmha-v2": "`fmha-v2`: TensorRT-LLM's FMHAv2 through FlashInfer (skip-softmax, Hopper)",
    "fmha-v2-fp8": "`fmha-v2-fp8`: TensorRT-LLM's FMHAv2 in fp8 e4m3 through FlashInfer (Hopper)",
    "triton": "`triton`: diffusers-trtllm's own Triton kernel",
    "gluon": "`gluon`: diffusers-trtllm's own Gluon kernel (Hopper)",
    "sdpa": "`sdpa`: PyTorch's scaled_dot_product_attention",
    "reference": "`reference`: diffusers-trtllm's PyTorch reference of the kernels (the CPU route: exact, not fast)",
    "stock": "`stock`: the model's own Diffusers attention (calls the setting leaves to it)",
}
NOISE_NOTE = ("The tiny offline pipeline has RANDOM WEIGHTS and no text encoder (each prompt's text seeds random "
              "prompt embeddings): its images are noise, and its figures show only that the flow works end to end, "
              "not the quality or speed of any real model.")


def repository_url() -> str:
    """The project's repository, from the installed package's metadata (``[project.urls]`` in pyproject.toml)."""
    try:
        urls = importlib.metadata.metadata("diffusers-trtllm").get_all("Project-URL") or []
    except importlib.metadata.PackageNotFoundError:
        urls = []
    found = dict(u.split(", ", 1) for u in urls if ", " in u)
    url = found.get("Repository") or found.get("Homepage")
    if url is None:
        raise RuntimeError("the installed diffusers-trtllm names no Repository URL in its metadata; reinstall it "
                           "(pip install -e .) so that pyproject.toml's [project.urls] is read.")
    return url


def kernel_credits(routes: set[str]) -> list[str]:
    """The kernels of the routes that ran, in ``KERNELS``' order."""
    return [text for name, text in KERNELS.items() if name in routes] + sorted(set(routes) - set(KERNELS))


def quality(image: Any, reference: Any, lpips_net: Any = None) -> dict[str, float]:
    """PSNR (dB) and SSIM of ``image`` against ``reference`` (PIL images) with torchmetrics; LPIPS with a net."""
    import numpy as np
    import torch
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    def tensor(img: Any) -> torch.Tensor:
        return torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1)[None]

    x, y = tensor(image), tensor(reference)
    out = {"psnr": float(peak_signal_noise_ratio(x, y, data_range=1.0)),
           "ssim": float(structural_similarity_index_measure(x, y, data_range=1.0))}
    if lpips_net is not None:
        with torch.no_grad():
            out["lpips"] = float(lpips_net(x * 2 - 1, y * 2 - 1).mean())
    return out


def _lpips_net() -> Any:
    """The ``lpips`` package's AlexNet metric where it is installed (its weights ship with it), else None."""
    if importlib.util.find_spec("lpips") is None:
        return None
    import lpips

    return lpips.LPIPS(net="alex", verbose=False).eval()


class _AttentionTimer:
    """Seconds spent inside the attention modules of a pipeline's denoisers (a synchronize around each call)."""

    def __init__(self, pipe: Any) -> None:
        from .serving.modules import attention_modules, denoisers

        self.seconds = 0.0
        self._handles = []
        for root in denoisers(pipe).values():
            for _, module in attention_modules(root):
                self._handles.append(module.register_forward_pre_hook(self._start))
                self._handles.append(module.register_forward_hook(self._stop))

    def _sync(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _start(self, module: Any, args: Any) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def _stop(self, module: Any, args: Any, out: Any) -> None:
        self._sync()
        self.seconds += time.perf_counter() - self._t0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass
class CardRuns:
    """What the runs measured, per configuration (``dense``, ``setting``): images by (prompt, seed), seconds."""

    images: dict[str, dict[tuple[int, int], Any]] = field(default_factory=lambda: {"dense": {}, "setting": {}})
    seconds: dict[str, list[float]] = field(default_factory=lambda: {"dense": [], "setting": []})
    attention: dict[str, list[float]] = field(default_factory=lambda: {"dense": [], "setting": []})
    routes: set[str] = field(default_factory=set)
    #: The pipeline returned frames (a video): the card shows each run's first frame.
    video: bool = False


def _run_once(pipe: Any, inputs: dict, steps: int, seed: int) -> tuple[Any, float, float, bool]:
    """One pipeline run: (its first image or frame, wall seconds, seconds in attention modules, a video?)."""
    import torch

    from .demo import output_image

    timer = _AttentionTimer(pipe)
    device = getattr(pipe, "_execution_device", torch.device("cpu"))
    generator = torch.Generator(device).manual_seed(seed)
    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = pipe(**inputs, num_inference_steps=steps, generator=generator, output_type="pil")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    finally:
        timer.remove()
    return output_image(out, frame="first"), seconds, timer.seconds, hasattr(out, "frames")


def run_both(pipe: Any, proc: Any, prompts: list[dict], seeds: int, steps: int, progress: Callable) -> CardRuns:
    """Every prompt and seed dense (the model's own attention) and with ``proc`` (its calibration installed with it),
    on a GPU after one untimed warm-up of each; ``progress`` wraps the runs' iterator (tqdm)."""
    import torch

    from .serving import install, uninstall
    from .serving.timestep import attach_denoise_tracking

    runs = CardRuns()
    work = [(label, p, s) for label in ("dense", "setting") for p in range(len(prompts)) for s in range(seeds)]
    current = None
    for label, p, s in progress(work):
        if label != current:
            if label == "dense":
                uninstall(pipe)
            else:
                install(pipe, proc)
                attach_denoise_tracking(pipe, proc)  # the layers know each step's t (disabled_until_timestep)
            if torch.cuda.is_available():
                _run_once(pipe, prompts[0], steps, 0)  # warm-up: kernels built and caches filled before timing
            current = label
        if label == "setting":
            proc.reset_stats()
        image, seconds, attention, runs.video = _run_once(pipe, prompts[p], steps, s)
        runs.images[label][(p, s)] = image
        runs.seconds[label].append(seconds)
        runs.attention[label].append(attention)
        if label == "setting":
            runs.routes.update(r for row in proc.step_table() for r in row["routes"].split(",") if r)
    return runs


def prompt_inputs(prompts: list[str], offline_inputs: dict | None) -> list[dict]:
    """Each prompt as pipeline arguments: the text, or (the tiny pipeline has no text encoder) random embeddings
    seeded by the prompt's text, so the same prompt gives the same run."""
    import torch

    if offline_inputs is None:
        return [{"prompt": p} for p in prompts]
    out = []
    for prompt in prompts:
        g = torch.Generator().manual_seed(zlib.crc32(prompt.encode("utf-8")))
        embeds = {k: torch.randn(v.shape, generator=g) for k, v in offline_inputs.items() if k.endswith("prompt_embeds")}
        out.append({**embeds, "height": offline_inputs["height"], "width": offline_inputs["width"]})
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _speed(runs: CardRuns) -> dict[str, Any]:
    rows = {}
    for label in ("dense", "setting"):
        wall, attention = _mean(runs.seconds[label]), _mean(runs.attention[label])
        rows[label] = {"pipeline": f"{wall:.3f}", "attention": f"{attention:.3f}", "share": f"{attention / wall:.0%}",
                       "wall": wall, "attn": attention}
    ratio = {"pipeline": f"{rows['dense']['wall'] / rows['setting']['wall']:.2f}x",
             "attention": f"{rows['dense']['attn'] / rows['setting']['attn']:.2f}x"}
    return {**rows, "ratio": ratio}


def _side_by_side(runs: CardRuns, prompts: list[str], scores: list[dict], out: str, offline: bool) -> list[dict[str, str]]:
    """One PNG per prompt (its first seed): dense, the setting and their difference."""
    from .demo import comparison_image

    images = []
    for p, prompt in enumerate(prompts):
        path = os.path.join("images", f"prompt_{p}.png")
        lines = [f"PSNR {scores[p]['psnr']:.1f} dB, SSIM {scores[p]['ssim']:.3f}"]
        panels = [{"label": "dense", "image": runs.images["dense"][(p, 0)], "lines": [""]},
                  {"label": "this setting", "image": runs.images["setting"][(p, 0)], "lines": lines}]
        noise = "\nthe tiny offline pipeline: RANDOM WEIGHTS, the images are noise" if offline else ""
        frame = ", first frame" if runs.video else ""
        comparison_image(panels, os.path.join(out, path), f"{prompt[:60]} (seed 0{frame}){noise}")
        images.append({"path": path, "alt": f"dense and this setting, prompt {p + 1}, seed 0"})
    return images


def make_card(pipe: Any, proc: Any, prompts: list[str], inputs: list[dict], out: str, *, model_id: str, steps: int,
              seeds: int, calibration_note: str, repo_id: str | None, license: str, offline: bool,
              progress: Callable) -> str:
    """Run, measure and write the card folder ``out`` (``proc`` installed on ``pipe`` with its calibration).
    Returns the README's path."""
    import diffusers
    import torch
    from huggingface_hub import ModelCard, ModelCardData

    from .setting import SETTING_FILE, constructor_parameters

    runs = run_both(pipe, proc, inputs, seeds, steps, progress)
    lpips_net = _lpips_net()
    per_prompt = []
    for p, prompt in enumerate(prompts):
        scores = [quality(runs.images["setting"][(p, s)], runs.images["dense"][(p, s)], lpips_net) for s in range(seeds)]
        per_prompt.append({k: _mean([s[k] for s in scores]) for k in scores[0]})
    os.makedirs(out, exist_ok=True)
    images = _side_by_side(runs, prompts, per_prompt, out, offline)
    heatmap = proc.plot(os.path.join(out, "sparsity.png"), title="skipped-tile fraction, this setting")
    proc.save_pretrained(out)
    quant = proc._role_settings["self"].quant
    card_data = ModelCardData(
        library_name="diffusers-trtllm", base_model=model_id, license=license,
        pipeline_tag="text-to-video" if runs.video else "text-to-image",
        tags=["diffusers", "diffusers-trtllm", "attention", "skip-softmax", "sparse-attention"]
        + (["sage-attention", "quantization"] if quant is not None else []) + (["tiny-random"] if offline else []),
    )
    with open(os.path.join(out, SETTING_FILE), encoding="utf-8") as f:
        written = json.load(f)  # what the card describes is what was saved
    layers = written["calibration"] or {}
    speed = _speed(runs)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    speed_note = (f"Measured on {device}, whole pipeline and its attention modules, dense beside." if not offline else
                  "CPU: the setting runs on the reference route (a PyTorch oracle of the GPU kernels) and dense on "
                  "the model's own attention, so these times are the reference route's cost, not a speed; "
                  "run the command on a GPU for speed.")
    repository = repository_url()
    fmt = {"psnr": lambda v: "inf (identical)" if math.isinf(v) else f"{v:.2f}", "ssim": "{:.4f}".format,
           "lpips": "{:.3f}".format}
    card = ModelCard.from_template(
        card_data, template_path=os.path.join(os.path.dirname(__file__), "card_template.md"),
        title=f"diffusers-trtllm setting for {model_id}", base_model=model_id,
        load_pipe=("pipe, inputs = diffusers_trtllm.demo.build_demo_pipeline()" if offline else
                   f'pipe = DiffusionPipeline.from_pretrained("{model_id}", torch_dtype=torch.bfloat16).to("cuda")'),
        frame_note="first frame of each video, " if runs.video else "",
        base_model_link=f"{repository}/blob/main/diffusers_trtllm/demo.py" if offline else f"https://huggingface.co/{model_id}",
        repository=repository, quant=quant.dtype_qk if quant is not None else None,
        setting_file=SETTING_FILE, model_class=", ".join(sorted({s["model_class"] for s in layers.values()})) or
        type(pipe).__name__, num_layers=sum(len(s["layers"]) for s in layers.values()),
        noise_note=NOISE_NOTE if offline else None, repo_id=repo_id or f"YOUR_NAME/{os.path.basename(os.path.abspath(out))}",
        arguments=[(k, json.dumps(written[k])) for k in sorted(constructor_parameters(type(proc)))],
        calibration_note=calibration_note, device=device, speed_note=speed_note, runs=len(prompts) * seeds,
        dense=speed["dense"], setting=speed["setting"], ratio=speed["ratio"], steps=steps,
        size=None, seeds=seeds, lpips=lpips_net is not None,
        quality=[{"prompt": prompt[:80].replace("|", "/"), **{k: fmt[k](v) for k, v in row.items()}}
                 for prompt, row in zip(prompts, per_prompt)],
        images=images, heatmap=os.path.basename(heatmap),
        heatmap_note=f"the last run: prompt {len(prompts)}, seed {seeds - 1}",
        credits=kernel_credits(runs.routes), version=__version__, diffusers_version=diffusers.__version__,
        torch_version=torch.__version__,
    )
    path = os.path.join(out, "README.md")
    card.save(path)
    return path
