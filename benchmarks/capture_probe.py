"""Where a served call breaks a CUDA graph capture (issue 57): the op's refusal lifted, a small Flux's forward
captured with ``torch.cuda.graph`` after an eager warm-up, and the failing frames of ours printed.

    python3 benchmarks/capture_probe.py [--settings defaults,int8]
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compile_check import SETTINGS, small_flux  # noqa: E402

from diffusers_trtllm import TrtllmAttnProcessor  # noqa: E402
from diffusers_trtllm.serving import intercept  # noqa: E402


def probe(setting: str) -> None:
    model, inputs = small_flux()
    model.set_attn_processor(TrtllmAttnProcessor(**SETTINGS[setting]))
    intercept._refuse_graph_capture = lambda query: None
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                model(**inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                model(**inputs)
            print(f"{setting}: captured")
        except Exception as exc:  # the probe's finding
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if "diffusers_trtllm" in f.filename]
            print(f"{setting}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            for f in frames[-6:]:
                print(f"    {Path(f.filename).name}:{f.lineno} {f.name}: {f.line}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default=",".join(SETTINGS))
    for setting in p.parse_args().settings.split(","):
        probe(setting)


if __name__ == "__main__":
    main()
