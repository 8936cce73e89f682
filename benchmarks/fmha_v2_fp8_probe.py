"""Which ragged batches FlashInfer's e4m3 FMHAv2 gets right (H200 diagnostic for the ``fmha-v2-fp8`` route).

Runs the route's kernel directly (its reasons bypassed) on batches with a hole of padded
keys in each row: as many queries as keys, fewer queries than keys, more queries than
keys, grouped-query heads; head dims 64 and 128; three repeats each (NaNs came and went
between runs for the bf16 kernels). Prints rel-L1 against fp32 dense attention, the
reference's own per-block SAGE fp8 error on the same batch, and NaN counts; writes JSON.

    python3 benchmarks/fmha_v2_fp8_probe.py --out benchmarks/results/fmha_v2_fp8_probe_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from diffusers_trtllm.bench.inputs import holed_batch
from diffusers_trtllm.bench.report import environment
from diffusers_trtllm.measure import rel_l1
from diffusers_trtllm.config import QuantConfig
from diffusers_trtllm.kernels.fmha_v2_fp8 import FmhaV2Fp8Route
from diffusers_trtllm.kernels.reference import reference_attention
from diffusers_trtllm.routing.registry import AttentionCall

HEADS = 4
FP8 = QuantConfig(dtype_qk="fp8_e4m3")


def batch(queries: str, dim: int, kv_heads: int, seed: int):
    q, k, v, layout = holed_batch(heads=HEADS, kv_heads=kv_heads, head_dim=dim, queries=queries, seed=seed)
    return layout.pack_q(q), layout.pack_kv(k), layout.pack_kv(v), layout


def reference(q, k, v, layout, quant=None):
    heads = q.shape[1]
    rep = lambda x: x.float().repeat_interleave(heads // x.shape[1], dim=1)  # noqa: E731
    return reference_attention(
        q.float(), rep(k), rep(v), layout.cu_seqlens_q, layout.cu_seqlens_kv, layout.q_lens, layout.kv_lens,
        softmax_scale=q.shape[-1] ** -0.5, quant=quant, out_dtype=torch.float32,
    ).out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/fmha_v2_fp8_probe_h200.json"))
    args = p.parse_args()
    route, rows = FmhaV2Fp8Route(), []
    for queries, dim, kv_heads in (("equal", 128, HEADS), ("equal", 64, HEADS), ("fewer", 128, HEADS),
                                   ("more", 128, HEADS), ("more", 64, HEADS), ("equal", 128, HEADS // 2)):
        for seed in range(3):
            q, k, v, layout = batch(queries, dim, kv_heads, seed)
            dense = reference(q, k, v, layout)
            emulated = rel_l1(reference(q, k, v, layout, FP8), dense)
            out = route.run(AttentionCall(q, k, v, layout, dim**-0.5, quant=FP8)).out.float()
            rows.append({"queries": queries, "head_dim": dim, "kv_heads": kv_heads, "seed": seed,
                         "rel_l1": rel_l1(out, dense), "reference_sage_fp8_rel_l1": emulated,
                         "nan": int(out.isnan().sum())})
            print(f"{queries:6s} D={dim:3d} kv_heads={kv_heads} seed={seed}: rel-L1 {rows[-1]['rel_l1']:.4f} "
                  f"(per-block emulation {emulated:.4f}), NaN {rows[-1]['nan']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = environment("cuda")
    env["command"] = "python3 " + " ".join(sys.argv)
    args.out.write_text(json.dumps({"environment": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
