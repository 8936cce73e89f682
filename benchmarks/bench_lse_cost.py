"""What returning the log-sum-exp costs each route, on one ring-attention KV-shard call.

Under ring attention every call returns its rows' log-sum-exp so Diffusers can merge the KV
shards. For ``fmha-v2`` that means FlashInfer's softmax stats, which it returns only with K
and V stacked (``CONTIGUOUS_Q_KV``): one copy of K and V per call. This times each route with
and without the log-sum-exp on the shard call of a Wan2.1-14B 720p forward under ring degree 2
(37,800 queries over 37,800 keys, 40 heads, head dim 128), against cuDNN SDPA in the same run,
with the output's accuracy against fp32 dense beside it:

    python benchmarks/bench_lse_cost.py --out benchmarks/results/lse_cost_h200

Writes ``<out>.json`` and ``<out>.md`` (GPU, versions and this command included).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers_trtllm.bench.inputs import Shape, structured_qkv  # noqa: E402
from diffusers_trtllm.bench.report import environment  # noqa: E402
from diffusers_trtllm.bench.timing import time_fn  # noqa: E402
from diffusers_trtllm.measure import cosine, rel_l1
from diffusers_trtllm.config import QuantConfig  # noqa: E402
from diffusers_trtllm.layout import PackedLayout  # noqa: E402
from diffusers_trtllm.routing.registry import AttentionCall, get_route  # noqa: E402

#: (label, route, skip-softmax on, SAGE dtype or None)
CASES = (
    ("fa3 dense", "fa3", False, None),
    ("fmha-v2 dense", "fmha-v2", False, None),
    ("fmha-v2 + skip", "fmha-v2", True, None),
    ("fmha-v2-fp8 + skip", "fmha-v2-fp8", True, "fp8_e4m3"),
    ("triton + skip", "triton", True, None),
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=37800, help="queries and keys of the shard call")
    p.add_argument("--heads", type=int, default=40)
    p.add_argument("--threshold", type=float, default=0.05, help="skip-softmax lambda (at the shard's KV length)")
    p.add_argument("--acc-heads", type=int, default=2, help="heads checked against fp32 dense")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/lse_cost"))
    args = p.parse_args(argv)

    device = torch.device("cuda")
    shape = Shape("ring2_shard", 1, args.tokens, args.heads, 128)
    q, k, v = (x[0] for x in structured_qkv(shape, device=device))  # [tokens, heads, dim]
    layout = PackedLayout.dense(1, args.tokens, args.tokens, device)
    scale = 128**-0.5
    sub = slice(0, args.acc_heads)
    ref = F.scaled_dot_product_attention(*(x[:, sub].float().transpose(0, 1) for x in (q, k, v))).transpose(0, 1)

    def sdpa():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(*(x.unsqueeze(0).transpose(1, 2) for x in (q, k, v)))

    cudnn_ms = time_fn(sdpa, device).median_ms
    stack_ms = time_fn(lambda: torch.stack((k, v), dim=1), device).median_ms
    rows = []
    for label, route_name, skip, sage in CASES:
        route = get_route(route_name)
        row = {"case": label, "route": route_name}
        for lse in (False, True):
            call = AttentionCall(q, k, v, layout, scale, skip_factor=args.threshold * args.tokens if skip else None,
                                 quant=QuantConfig(dtype_qk=sage) if sage else None, return_lse=lse)
            reasons = route.not_supported_reasons(call)
            if reasons:
                row["error"] = "; ".join(reasons)
                break
            key = "with_lse" if lse else "without_lse"
            row[f"{key}_ms"] = time_fn(lambda: route.run(call), device).median_ms
            row[f"{key}_vs_cudnn"] = cudnn_ms / row[f"{key}_ms"]
            out = route.run(call).out[:, sub].float()
            row[f"{key}_rel_l1"], row[f"{key}_cosine"] = rel_l1(out, ref), cosine(out, ref)
        if "with_lse_ms" in row:
            row["lse_cost"] = row["with_lse_ms"] / row["without_lse_ms"] - 1.0
        rows.append(row)
        print(row, flush=True)

    env = environment("cuda")
    env["command"] = " ".join(["python", "benchmarks/bench_lse_cost.py", *(argv if argv is not None else sys.argv[1:])])
    data = {"env": env, "shape": {"tokens": args.tokens, "heads": args.heads, "head_dim": 128},
            "threshold": args.threshold, "cudnn_ms": cudnn_ms, "stack_kv_ms": stack_ms, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    md = [
        "# What the log-sum-exp costs: one ring-2 KV-shard call",
        "",
        f"GPU: {env.get('gpu')}, driver {env.get('driver')}, torch {env['torch']}, FlashInfer {env['flashinfer']}, "
        f"Triton {env['triton']}.",
        f"Command: `{env['command']}`",
        "",
        f"{args.tokens:,} queries x {args.tokens:,} keys, {args.heads} heads, head dim 128, bf16 "
        f"(`bench.inputs.structured_qkv`); skip-softmax at lambda {args.threshold}. cuDNN SDPA {cudnn_ms:.2f} ms "
        f"in the same run; `torch.stack((k, v), 1)` alone {stack_ms:.2f} ms. rel-L1 / cosine: output against "
        f"fp32 dense on {args.acc_heads} heads.",
        "",
        "| route | without LSE ms | vs cuDNN | with LSE ms | vs cuDNN | LSE cost | rel-L1 (without / with) | cosine (with) |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['case']} | {r['error']} | | | | | | |")
            continue
        md.append(f"| {r['case']} | {r['without_lse_ms']:.2f} | {r['without_lse_vs_cudnn']:.3f} | {r['with_lse_ms']:.2f} | "
                  f"{r['with_lse_vs_cudnn']:.3f} | {r['lse_cost']:+.1%} | {r['without_lse_rel_l1']:.4f} / "
                  f"{r['with_lse_rel_l1']:.4f} | {r['with_lse_cosine']:.5f} |")
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
