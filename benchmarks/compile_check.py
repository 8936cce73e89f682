"""Our processor under each ``torch.compile`` use of issue 57, on a small Flux on the GPU (random weights).

    python3 benchmarks/compile_check.py --out X.json

Per processor setting (defaults; int8 SAGE with ``policy="always"``) and compile use: regional
(``compile_repeated_blocks(fullgraph=True)``), whole model ``mode="max-autotune-no-cudagraphs"`` (``fullgraph=True``,
so a graph break fails it) and whole model ``mode="reduce-overhead"`` (CUDA graphs): whether it compiled, the graph
breaks Dynamo counted, whether Inductor skipped CUDA graphs and why, three compiled forwards' rel-L1 against the
eager forward, and the first error line where one was raised. ``--gemm-backends ATEN`` (the default) leaves
max-autotune nothing to autotune in the matrix products (Inductor's Triton GEMM templates took past 150 s on an
H100): what this checks is our op inside the compiled graph, not Inductor's GEMMs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from diffusers_trtllm import TrtllmAttnProcessor, install
from diffusers_trtllm.measure import rel_l1

SETTINGS = {"defaults": {}, "int8": {"quant": "int8", "policy": "always"}}
USES = ("regional", "max-autotune-no-cudagraphs", "reduce-overhead")


def small_flux(tokens: int = 1024, text: int = 128):
    """A two-block Flux with Flux.1-dev's attention geometry (24 heads x 128), bf16 on the GPU, and its inputs."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                   attention_head_dim=128, num_attention_heads=24, joint_attention_dim=256,
                                   pooled_projection_dim=64, axes_dims_rope=[16, 56, 56]).to("cuda", torch.bfloat16).eval()
    g = torch.Generator("cuda").manual_seed(1)
    side = int(tokens**0.5)
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(side).float(), torch.arange(side).float(), indexing="ij"), -1)
    inputs = dict(hidden_states=torch.randn(1, tokens, 64, device="cuda", dtype=torch.bfloat16, generator=g),
                  encoder_hidden_states=torch.randn(1, text, 256, device="cuda", dtype=torch.bfloat16, generator=g),
                  pooled_projections=torch.randn(1, 64, device="cuda", dtype=torch.bfloat16, generator=g),
                  timestep=torch.full((1,), 0.5, device="cuda", dtype=torch.bfloat16),
                  img_ids=img_ids.reshape(-1, 3).to("cuda"), txt_ids=torch.zeros(text, 3, device="cuda"),
                  return_dict=False)
    return model, inputs


def check(setting: str, use: str) -> dict:
    from torch._dynamo.utils import counters

    model, inputs = small_flux()
    proc = TrtllmAttnProcessor(**SETTINGS[setting])
    install(model, proc)
    row = dict(setting=setting, use=use)
    with torch.no_grad():
        eager = model(**inputs)[0]
        row["routes"] = sorted({r["route"] for r in proc.layer_step_rows()})
        torch._dynamo.reset()
        counters.clear()
        start = time.perf_counter()
        try:
            if use == "regional":
                model.compile_repeated_blocks(fullgraph=True)
                runner = model
            else:
                runner = torch.compile(model, mode=use, fullgraph=True)
            outs = [runner(**inputs)[0] for _ in range(3)]
            torch.cuda.synchronize()
            row.update(compiled=True, seconds=time.perf_counter() - start,
                       rel_l1=[rel_l1(o.float(), eager.float()) for o in outs])
        except Exception as err:
            row.update(compiled=False, seconds=time.perf_counter() - start,
                       error=f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}")
    row["graph_breaks"] = dict(counters["graph_break"])
    row["cudagraph_skips"] = dict(counters["inductor"]).get("cudagraph_skips")
    row["stats"] = {k: v for k, v in dict(counters["stats"]).items() if k in ("unique_graphs", "calls_captured")}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--uses", default=",".join(USES))
    p.add_argument("--out", default=None)
    p.add_argument("--gemm-backends", default="ATEN", help="Inductor's max_autotune_gemm_backends ('' keeps its own)")
    args = p.parse_args()
    if args.gemm_backends:
        import torch._inductor.config as inductor_config

        inductor_config.max_autotune_gemm_backends = args.gemm_backends
    import logging

    logging.getLogger("torch._inductor.cudagraph_trees").setLevel(logging.INFO)
    result = dict(command=" ".join(["python3", *sys.argv]), torch=torch.__version__, gpu=torch.cuda.get_device_name(),
                  rows=[])
    for setting in args.settings.split(","):
        for use in args.uses.split(","):
            row = check(setting, use)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
